"""PowerInfer predictors: a per-layer low-rank MLP that says which FFN neurons will fire."""

from __future__ import annotations

import torch

from hotcold.ops import Weight, linear


class Predictor:
    """Neuron i fires iff (fc2 @ relu(fc1 @ p))[i] >= threshold (no sigmoid, no bias: the file format's rule).

    fc1: [R, D], fc2: [F, R] (R, the rank, may differ per layer). p is the architecture's predictor input
    (the residual after attention for llama/bamboo/opt, the layer input for falcon), not the FFN input.
    """

    def __init__(self, fc1: Weight, fc2: Weight, threshold: float):
        self.fc1 = fc1
        self.fc2 = fc2
        self.threshold = threshold

    @property
    def rank(self) -> int:
        return self.fc1.shape[0]

    def logits(self, p: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, F]
        p = p.to(self.fc1.device)  # a GPU layer's predictor may have stayed on the CPU, and vice versa
        return linear(torch.relu(linear(p, self.fc1)), self.fc2)

    def __call__(self, p: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, F] bool
        return self.logits(p) >= self.threshold
