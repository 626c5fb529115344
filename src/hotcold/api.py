"""Public Python API (placeholder while the foundation lands)."""


class Model:  # replaced by the real implementation in the foundation commit
    pass


def load(path=None, **kwargs):
    raise NotImplementedError
