"""Models by name: `org/repo[:TAG]` (or `hf.co/org/repo[:TAG]`) resolved to GGUF files in the standard
Hugging Face cache, downloaded with `huggingface_hub` (resume, progress bar, nothing under the final name
until a file is whole).

The file a name means is chosen as llama.cpp's `-hf` chooses it (common/download.cpp, find_best_model): TAG
matched case-insensitively as `TAG[.-]` in the file's path; no TAG: Q4_K_M, then Q8_0, then the first model
GGUF; never an `mmproj`, `imatrix` or draft (`mtp-`, `eagle3-`, `dflash-`, `dspark-`) file; of a split model
(`NAME-00001-of-00003.gguf`) the first part, and then every part. One addition for PowerInfer repos: without
a TAG a `*.powerinfer.gguf` file is preferred (the repos publish the dense original beside it), and the
`activation/` statistics beside the chosen file, and its `.generated.gpuidx` if published, come along.

Everything is read from the environment at call time, as `huggingface_hub` reads it at import: `HF_ENDPOINT`,
`HF_TOKEN`, `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE`. Offline (that variable, or `offline=True`), a
cached model resolves without any network call; online, a cached model is still checked against the Hub
(as llama.cpp does), and when the Hub cannot be reached the cached copy is used with a note."""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from hotcold.hub_names import (  # noqa: F401  (the names are hotcold.hub's API too)
    ACTIVATION_DIR,
    GPUIDX_SUFFIX,
    HubError,
    ModelName,
    Plan,
    available_tags,
    choose_files,
    is_model_file,
    parse_name,
    split_info,
    tag_of,
)

# ---------------------------------------------------------------------------------------------------
# Environment and cache


def cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub), read now, not at import."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline_from_env() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _repo_folder(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def cached_snapshot(repo: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder `revision` points at, or None."""
    folder = _repo_folder(repo)
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _files_under(folder: Path) -> list[str]:
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()
    )


# ---------------------------------------------------------------------------------------------------
# Pull


def resolve(model: str | os.PathLike[str] | None, *, offline: bool | None = None, quiet: bool = False):
    """A model argument as a local path: None stays None (the bundled model), a local path stays itself, a
    model name is pulled (or found in the cache) and the path of its model file returned."""
    if model is None:
        return None
    name = parse_name(model)
    return Path(model) if name is None else pull(name, offline=offline, quiet=quiet)


def pull(name: ModelName | str, *, offline: bool | None = None, quiet: bool = False) -> Path:
    """Download (or find in the cache) the files `name` means; the local path of its model file (of a split
    model: its first part, with the others beside it)."""
    if isinstance(name, str):
        parsed = parse_name(name)
        if parsed is None:
            raise HubError(f"{name!r} is not a model name (ORG/REPO[:TAG]) and no such file")
        name = parsed
    offline = offline_from_env() if offline is None else offline
    if offline:
        return _from_cache(name, reason="offline")
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    api = HfApi(endpoint=endpoint())
    try:
        _probe(name.repo)
        paths = [f.path for f in api.list_repo_tree(name.repo, recursive=True) if hasattr(f, "size")]
    except hf_errors.GatedRepoError:
        raise HubError(
            f"{name.repo} is gated: accept its terms on {endpoint()}/{name.repo} and set HF_TOKEN "
            "(or run `hf auth login`)"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        token_hint = "" if _has_token() else " (if it is private, set HF_TOKEN)"
        raise HubError(
            f"no model repository {name.repo} on {endpoint()}{token_hint}, and no local file {str(name)!r}"
        ) from None
    except hf_errors.HfHubHTTPError as exc:
        raise HubError(f"{name.repo}: the Hub answered {_status(exc)} listing its files") from None
    except (OSError, *_network_errors()) as exc:  # no route, DNS, refused, timed out
        cached = _cached_plan(name)
        if cached is not None:
            if not quiet:
                print(f"hotcold: {endpoint()} unreachable ({type(exc).__name__}); using the cached {name}",
                      file=sys.stderr)  # fmt: skip
            return cached
        raise HubError(
            f"cannot reach {endpoint()} to fetch {name} ({type(exc).__name__}) and it is not cached"
        ) from None
    plan = choose_files(paths, name.tag, name.repo)
    return _download(name, plan, quiet=quiet)


def _probe(repo: str) -> None:
    """One request, no retries, to find out whether the Hub answers at all: huggingface_hub retries a failed
    listing five times over ~23 s, which an offline user with the model cached should not wait through."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = f"{endpoint()}/api/models/{repo}/tree/main"
    hf_raise_for_status(get_session().get(url, headers=build_hf_headers(), timeout=10))


def _download(name: ModelName, plan: Plan, *, quiet: bool) -> Path:
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    local: dict[str, Path] = {}
    if quiet:
        disable_progress_bars()
    try:
        # a commit pushed during a long pull links the later files into a newer snapshot: link the earlier
        # ones there too (their blobs are cached: no download when unchanged), so every part lies side by side
        for _ in range(3):
            newest = cached_snapshot(name.repo)
            todo = [p for p in plan.files if p not in local or newest is None or not (newest / p).exists()]
            if not todo:
                break
            for path in todo:
                local[path] = _download_one(name, path)
    finally:
        if quiet:
            enable_progress_bars()
    newest = cached_snapshot(name.repo)
    if newest is not None and all((newest / p).exists() for p in plan.files):
        return newest / plan.primary
    return local[plan.primary]


def _download_one(name: ModelName, path: str) -> Path:
    """One file into the cache (resumable: _fetch_blob), linked into the snapshot of the commit it came from."""
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import hf_hub_download

    try:
        _fetch_blob(name.repo, path)
        # the blob is in place: the library links it into the snapshot and records the commit
        return Path(hf_hub_download(name.repo, path, cache_dir=cache_dir(), endpoint=endpoint()))
    except hf_errors.GatedRepoError:
        raise HubError(f"{name.repo} is gated: accept its terms and set HF_TOKEN") from None
    except hf_errors.HfHubHTTPError as exc:
        raise HubError(f"{name.repo}: downloading {path} failed: the Hub answered {_status(exc)}") from None
    except (OSError, *_network_errors()) as exc:
        raise HubError(
            f"{name.repo}: downloading {path} failed ({type(exc).__name__}: {exc}); "
            "run the same command again to resume"
        ) from None


_BLOB_NAME = re.compile(r"^([0-9a-f]{40}|[0-9a-f]{64})$")  # a git blob id or an LFS sha256: never a path


def _fetch_blob(repo: str, path: str) -> None:
    """Download one file's bytes to the cache's blob for it, resuming a download an earlier run left.

    Written here, not left to `hf_hub_download`, because huggingface_hub 1.x/2.x writes to a temporary file
    unique to each process and deletes it on failure (its PR #4228): an interrupted multi-GB download would
    start over. The partial file is `blobs/<etag>.incomplete`, the name huggingface_hub 0.x resumed from;
    the library's own file-lock path keeps two processes from appending to it at once; the blob gets its
    final name only when its size is the size the Hub announced."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    meta = get_hf_file_metadata(hf_hub_url(repo, path, endpoint=endpoint()), endpoint=endpoint())
    if meta.etag is None or not _BLOB_NAME.match(meta.etag):
        # the cache names the blob by it (huggingface_hub too, unchecked): anything but a hash could be a path
        raise HubError(
            f"{repo}: {path}: the server's ETag {meta.etag!r} is not a content hash; not caching it"
        )
    if meta.size is None:
        return  # the library's own download handles a file of unknown size
    folder = repo_folder_name(repo_id=repo, repo_type="model")
    blob = cache_dir() / folder / "blobs" / meta.etag
    if blob.exists():
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock = cache_dir() / ".locks" / folder / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(blob.name + ".incomplete")
    with WeakFileLock(lock):
        if blob.exists():
            return
        with open(partial, "ab") as f:
            done = f.tell()
            if done > meta.size:  # not a prefix of this file: start again
                f.truncate(0)
                done = 0
            headers = build_hf_headers()
            headers["Accept-Encoding"] = "identity"
            if urlparse(meta.location).netloc != urlparse(endpoint()).netloc:
                # a redirect to a CDN or storage host: the Hub's token stays with the Hub (as huggingface_hub does)
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            http_get(
                meta.location,
                f,
                resume_size=done,
                headers=headers,
                expected_size=meta.size,
                displayed_filename=path.rsplit("/", 1)[-1],
            )
        if partial.stat().st_size != meta.size:
            raise OSError(f"{path}: got {partial.stat().st_size} bytes, the Hub announced {meta.size}")
        os.replace(partial, blob)


def _from_cache(name: ModelName, *, reason: str) -> Path:
    found = _cached_plan(name)
    if found is None:
        raise HubError(f"{name} is not in the cache ({cache_dir()}) and hotcold is {reason}: pull it first")
    return found


def _cached_plan(name: ModelName) -> Path | None:
    """The model file of `name` in the cached snapshot, when every file it needs is there; no network."""
    snapshot = cached_snapshot(name.repo)
    if snapshot is None:
        return None
    paths = _files_under(snapshot)
    try:
        plan = choose_files(paths, name.tag, name.repo)
    except HubError:
        return None
    if not all((snapshot / p).exists() for p in plan.model_files):
        return None
    return snapshot / plan.primary


def _has_token() -> bool:
    if os.environ.get("HF_TOKEN"):
        return True
    try:
        from huggingface_hub import get_token

        return get_token() is not None
    except Exception:  # an unreadable token file is "no token" for this hint
        return False


def _status(exc) -> str:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return f"HTTP {code}" if code else type(exc).__name__


def _network_errors() -> tuple[type[BaseException], ...]:
    """The transport errors of the HTTP client huggingface_hub uses (httpx2 in 2.x, httpx in 1.x)."""
    errors: list[type[BaseException]] = []
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


# ---------------------------------------------------------------------------------------------------
# List and remove


@dataclass(frozen=True)
class CachedModel:
    name: str  # org/repo
    tag: str
    size: int  # bytes, every part
    path: Path  # the model file (first part)


def list_models() -> list[CachedModel]:
    """Every GGUF model file in the cache's snapshots (one row per model: a split model is one row)."""
    rows = []
    root = cache_dir()
    if not root.is_dir():
        return rows
    for folder in sorted(root.glob("models--*")):
        repo = folder.name[len("models--") :].replace("--", "/", 1)
        snapshot = cached_snapshot(repo)
        if snapshot is None:
            continue
        paths = _files_under(snapshot)
        for p in paths:
            prefix, part, parts = split_info(p)
            if not is_model_file(p) or part != 1:
                continue
            siblings = [q for q in paths if split_info(q)[0] == prefix and split_info(q)[2] == parts]
            size = sum((snapshot / q).stat().st_size for q in siblings if (snapshot / q).exists())
            rows.append(CachedModel(repo, tag_of(p), size, snapshot / p))
    return rows


def remove(name: ModelName | str) -> list[Path]:
    """Remove a pulled model from the cache: `org/repo` the whole repository, `org/repo:TAG` the files of that
    tag (and the repository once no model file is left). The removed paths (files, or the repo folder)."""
    if isinstance(name, str):
        parsed = parse_name(name)
        if parsed is None:
            raise HubError(f"{name!r} is not a model name (ORG/REPO[:TAG])")
        name = parsed
    folder = _repo_folder(name.repo)
    if not folder.is_dir():
        raise HubError(f"{name.repo} is not in the cache ({cache_dir()})")
    if name.tag is None:
        shutil.rmtree(folder)
        return [folder]
    snapshot = cached_snapshot(name.repo)
    paths = _files_under(snapshot) if snapshot else []
    tagged = re.compile(re.escape(name.tag) + r"[.-]", re.IGNORECASE)
    files = [
        p for p in paths if is_model_file(p) and tagged.search(p)
    ]  # every part present, even of a half pull
    if not files:
        raise HubError(
            f"{name.repo} has no cached file tagged {name.tag!r}; cached: {', '.join(available_tags(paths))}"
        )
    removed = []
    for p in files:
        link = snapshot / p
        blob = link.resolve() if link.is_symlink() else None
        link.unlink()
        removed.append(link)
        # only the cache's own blob, and only when no other file or revision links it
        if (
            blob is not None
            and blob.parent == (folder / "blobs").resolve()
            and not _still_linked(folder, blob)
        ):
            blob.unlink(missing_ok=True)
    if not any(is_model_file(p) for p in _files_under(snapshot)):
        shutil.rmtree(folder)
        return [folder]
    return removed


def _still_linked(folder: Path, blob: Path) -> bool:
    for link in (folder / "snapshots").rglob("*"):
        if link.is_symlink() and link.resolve() == blob:
            return True
    return False
