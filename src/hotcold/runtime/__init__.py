"""Running a loaded model: the Engine (engine), one sequence's generation (generation) and sampling, continuous
batching, sequence state, the decoders chosen at load (decoders: cpu_step, decode_step) and the output head's
screen (head_screen)."""
