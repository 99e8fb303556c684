"""Hugging Face Hub model IDs: from "org/name" to a local snapshot folder of the files we read.

    hub_snapshot("meta-llama/Meta-Llama-3-8B", revision="main")      -> .../snapshots/<commit>

The download is huggingface_hub's ``snapshot_download``, into the standard Hugging Face cache
(``models--org--name/snapshots/<commit>/...`` with ``refs/<branch>``), so a model fetched by
transformers or vLLM is not fetched again, and ours is theirs. Only the files the engine reads
are fetched (CHECKPOINT_FILES), or only config.json (CONFIG_FILES) for a memory plan.

The environment is read at each call, not when huggingface_hub is imported (which fixes its
own constants then): HF_HUB_CACHE, then HF_HOME (its "hub" folder) choose the cache, a
download_dir argument overrides both (vLLM's meaning); HF_HUB_OFFLINE=1 never touches the
network and takes the cached snapshot of the revision (a branch or tag through refs/, a commit
hash directly). huggingface_hub itself is imported inside hub_snapshot: importing this module
costs nothing, so `jaxserve --help` stays fast.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re

logger = logging.getLogger("jaxserve")

# What the loaders read from a checkpoint folder (hf_loader.py, tokenizer.py): nothing else is
# downloaded (no PyTorch .bin weights, no original/ consolidated copies, no README).
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    # A sentencepiece-only repository (no tokenizer.json) is refused at load naming this file,
    # rather than loading with no tokenizer (tokenizer.py).
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
)
# What a memory plan, an execution plan or load_arch reads: the architecture and its dtype.
CONFIG_FILES = ("config.json",)
DEFAULT_REVISION = "main"

# A Hub repository id: "name" or "org/name"; each part starts with a letter or digit and holds
# letters, digits, "-", "_" and "."; the Hub also refuses "--" and ".." inside and a ".git"
# ending, and ids longer than 96 characters.
_ID_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"(?:{_ID_PART}/)?{_ID_PART}")
_MAX_ID_LENGTH = 96
_TRUE = ("1", "on", "yes", "true")


class HubUnavailableError(FileNotFoundError):
    """A Hub model ID that could not be resolved to a snapshot; the message says why (the
    caller prefixes what else it tried)."""


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hub model ID ("org/name" or "name"); a path with
    more parts, an absolute path, "./x", "~/x" or "x/.." does not."""
    return (
        len(name) <= _MAX_ID_LENGTH
        and _HUB_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith(".git")
    )


def hub_cache_dir(download_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The Hugging Face hub cache folder: download_dir when given, else $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (read
    now, not at huggingface_hub's import)."""
    if download_dir is not None:
        return pathlib.Path(download_dir).expanduser()
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return pathlib.Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME")
    if not home:
        xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.path.join(xdg, "huggingface")
    return pathlib.Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE) is set to a true value
    now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def repo_folder(cache: pathlib.Path, repo_id: str) -> pathlib.Path:
    """The folder of one model repository in the hub cache `cache`: models--org--name (the
    huggingface_hub cache layout: blobs/, refs/<branch> holding a commit, snapshots/<commit>/)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def hub_snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None,
    allow_patterns: tuple[str, ...] = CHECKPOINT_FILES,
) -> pathlib.Path:
    """The local snapshot folder of a Hub model at `revision`, fetching the files matching
    `allow_patterns` that the cache lacks (none when offline).

    Args:
        repo_id: "org/name" or "name" (see is_hub_id).
        revision: a branch, tag or commit hash; None: "main".
        download_dir: the cache folder (None: hub_cache_dir()).
        allow_patterns: glob patterns of the files to fetch.

    Returns:
        The snapshot folder, <cache>/models--org--name/snapshots/<commit>.

    Raises:
        ValueError: repo_id is not of the form of a Hub model ID.
        HubUnavailableError: offline and not cached, no such repository or revision, a gated
            repository without access, the Hub unreachable; the message says which.
    """
    if not is_hub_id(repo_id):
        raise ValueError(f"{repo_id!r} is not a Hugging Face Hub model ID ('org/name')")
    revision = revision or DEFAULT_REVISION
    folder = _download(repo_id, revision, hub_cache_dir(download_dir), allow_patterns)
    logger.info("model %r (revision %r): Hugging Face Hub snapshot %s", repo_id, revision, folder)
    return pathlib.Path(folder)


def _download(
    repo_id: str, revision: str, cache: pathlib.Path, allow_patterns: tuple[str, ...]
) -> str:
    """snapshot_download of repo_id at revision into `cache` (from the cache alone when
    hub_offline()), its errors raised as HubUnavailableError saying which case it is."""
    from huggingface_hub import errors, snapshot_download

    offline = hub_offline()
    where = f"{repo_id!r} at revision {revision!r}"
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            allow_patterns=list(allow_patterns),
            local_files_only=offline,
            library_name="jaxserve",
        )
    # IncompleteSnapshotError (absent from older huggingface_hub) before its base class,
    # LocalEntryNotFoundError; GatedRepoError before RepositoryNotFoundError, likewise.
    except getattr(errors, "IncompleteSnapshotError", ()) as e:
        raise HubUnavailableError(f"the cached snapshot of {where} is incomplete ({e})") from None
    except errors.LocalEntryNotFoundError as e:
        if offline:
            raise HubUnavailableError(_not_cached(repo_id, revision, cache)) from None
        raise HubUnavailableError(
            f"the Hub could not be reached ({_first_line(e)}) and "
            + _not_cached(repo_id, revision, cache, offline=False)
        ) from None
    except errors.GatedRepoError:
        raise HubUnavailableError(
            f"{repo_id!r} is a gated model on the Hub: accept its terms on huggingface.co and "
            "log in (hf auth login, or HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubUnavailableError(
            f"the Hub has no model {repo_id!r} (or it is private: log in with hf auth login, or "
            "set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubUnavailableError(
            f"the Hub model {repo_id!r} has no revision {revision!r}"
        ) from None
    except errors.HFValidationError as e:
        raise HubUnavailableError(f"{repo_id!r} is not a valid Hub model ID ({e})") from None
    except errors.HfHubHTTPError as e:
        raise HubUnavailableError(f"the Hub refused {where}: {_first_line(e)}") from None


def _not_cached(repo_id: str, revision: str, cache: pathlib.Path, *, offline: bool = True) -> str:
    """Why the cache cannot serve repo_id at revision: no folder of that model, or no snapshot
    of that revision (the cached ones listed)."""
    prefix = "HF_HUB_OFFLINE is set and " if offline else ""
    folder = repo_folder(cache, repo_id)
    snapshots = folder / "snapshots"
    if not snapshots.is_dir():
        return f"{prefix}the hub cache {cache} has no snapshot of {repo_id!r}"
    cached = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    refs = folder / "refs"
    branches = sorted(p.name for p in refs.iterdir()) if refs.is_dir() else []
    return (
        f"{prefix}the hub cache {cache} has no snapshot of {repo_id!r} at revision "
        f"{revision!r} (cached commits: {cached or 'none'}; refs: {branches or 'none'})"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
