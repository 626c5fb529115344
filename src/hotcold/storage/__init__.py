"""Models larger than memory (`--ram-budget GIB`): what every token reads and the hottest FFN neurons stay
resident, the other neurons' rows are read from the model file when the predictor selects them.

plan.py: the budget spent in order (plan_ram, pure but for reading the file's header and statistics);
reader.py: rows read with many preads in flight (RowReader); ffn.py: the FFN that computes on resident +
just-read rows with the kernels of every sparse CPU layer (StoredFFN), a neuron cache, the counters."""
