"""Model names (`ORG/REPO[:TAG]`) and which of a repository's files one means, as llama.cpp's `-hf` chooses
them (common/download.cpp, find_best_model): pure functions over file paths, no network, no cache.
hotcold.hub pulls what these choose."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

HUB_HOSTS = ("hf.co/", "huggingface.co/", "https://hf.co/", "https://huggingface.co/")
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's order when no TAG is given
NOT_MODEL_MARKS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
POWERINFER_SUFFIX = ".powerinfer.gguf"
ACTIVATION_DIR = "activation"
GPUIDX_SUFFIX = ".generated.gpuidx"

# an org or user and a repo as the Hub spells them; an optional :TAG of letters, digits, _ . -
_NAME = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?::(?P<tag>[A-Za-z0-9_.-]+))?$"
)
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG_IN_NAME = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


class HubError(ValueError):
    """A model name that cannot be resolved: the message is one line a person can act on."""


@dataclass(frozen=True)
class ModelName:
    repo: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


@dataclass(frozen=True)
class Plan:
    """The files one name needs: the model file(s) (a split model's parts, first part first) and what comes
    along (PowerInfer statistics, a published GPU index)."""

    primary: str
    model_files: tuple[str, ...]
    extras: tuple[str, ...] = field(default=())

    @property
    def files(self) -> tuple[str, ...]:
        return self.model_files + self.extras


# ---------------------------------------------------------------------------------------------------
# Names and file choice (pure)


def parse_name(text: str | os.PathLike[str]) -> ModelName | None:
    """`org/repo[:TAG]` or `hf.co/org/repo[:TAG]` as a ModelName; None for anything that is a local path
    (an existing file or folder, a name ending in .gguf, an absolute or ./ path)."""
    s = os.fspath(text)
    for host in HUB_HOSTS:
        if s.startswith(host):
            named = _NAME.match(s[len(host) :])
            if named is None:
                raise HubError(f"{s!r} is not a model name: expected {host}ORG/REPO[:TAG]")
            return ModelName(named["repo"], named["tag"])
    if os.path.exists(s) or s.lower().endswith((".gguf", ".bin")) or s.startswith(("/", ".", "~")):
        return None
    named = _NAME.match(s)
    return ModelName(named["repo"], named["tag"]) if named else None


def split_info(path: str) -> tuple[str, int, int]:
    """(prefix, part, parts) of a GGUF path: `x-00002-of-00003.gguf` -> ("x", 2, 3); one file: (stem, 1, 1)."""
    prefix = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    m = _SPLIT.match(prefix)
    return (m[1], int(m[2]), int(m[3])) if m else (prefix, 1, 1)


def tag_of(path: str) -> str:
    """The quantization tag a file name carries, as llama.cpp reads it: `Qwen3-8B-Q4_K_M.gguf` -> Q4_K_M,
    `llama-7b-relu.q4.powerinfer.gguf` -> POWERINFER (the text after the last - or . before .gguf)."""
    prefix, _, _ = split_info(path)
    m = _TAG_IN_NAME.search(prefix)
    return m[1].upper() if m else ""


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(mark in name for mark in NOT_MODEL_MARKS)


def available_tags(paths: list[str]) -> list[str]:
    """What a user may put after the colon: the tag of each model file (first parts only), sorted."""
    tags = set()
    for p in paths:
        if is_model_file(p) and split_info(p)[1] == 1:
            prefix = split_info(p)[0]
            name = prefix.rsplit("/", 1)[-1]
            # PowerInfer names put the type before .powerinfer (x.q4.powerinfer.gguf): offer "q4" too
            if name.lower().endswith(".powerinfer"):
                inner = _TAG_IN_NAME.search(name[: -len(".powerinfer")])
                tags.add(inner[1].upper() if inner else "POWERINFER")
            else:
                tags.add(tag_of(p) or name)
    return sorted(tags)


def choose_files(paths: list[str], tag: str | None, repo: str = "the repository") -> Plan:
    """The files `repo[:tag]` means among the repository's `paths` (llama.cpp's choice, module docstring)."""
    models = [p for p in paths if is_model_file(p) and split_info(p)[1] == 1]
    if not models:
        ggufs = [p for p in paths if p.lower().endswith(".gguf")]
        listed = f" (only {', '.join(ggufs[:6])})" if ggufs else ""
        raise HubError(f"{repo} has no GGUF model file{listed}")
    primary = None
    if tag:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        primary = next((p for p in models if pattern.search(p)), None)
        if primary is None:
            raise HubError(f"{repo} has no file tagged {tag!r}; its tags: {', '.join(available_tags(paths))}")
    else:
        for default in DEFAULT_TAGS:
            pattern = re.compile(re.escape(default) + r"[.-]", re.IGNORECASE)
            primary = next((p for p in models if pattern.search(p)), None)
            if primary is not None:
                break
        if primary is None:
            powerinfer = [p for p in models if p.lower().endswith(POWERINFER_SUFFIX)]
            primary = (powerinfer or models)[0]
    prefix, _, parts = split_info(primary)
    model_files = (primary,)
    if parts > 1:
        found = {
            split_info(p)[1]: p for p in paths if split_info(p)[0] == prefix and split_info(p)[2] == parts
        }
        missing = [i for i in range(1, parts + 1) if i not in found]
        if missing:
            raise HubError(
                f"{repo}: {primary} is part 1 of {parts}, but part(s) {missing} are not in the repository"
            )
        model_files = tuple(found[i] for i in range(1, parts + 1))
    folder = primary.rsplit("/", 1)[0] + "/" if "/" in primary else ""
    extras = [p for p in paths if p.startswith(folder + ACTIVATION_DIR + "/") and p.endswith(".pt")]
    extras += [p for p in paths if p == primary + GPUIDX_SUFFIX]
    return Plan(primary, model_files, tuple(sorted(extras)))
