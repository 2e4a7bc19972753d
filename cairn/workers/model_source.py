"""`ModelSource`: what `--model` and a Serve config's `model_dir` name, a checkpoint directory or a
Hugging Face id, and the local directory it resolves to.

Contract:
- `ModelSource.parse(text)`: a string naming an existing directory is that directory (made
  absolute), even where it also reads as an id. Otherwise `org/name` or `org/name@revision`
  (the hub's repo-id rules; a revision is a branch, a tag or a commit) is a hub id. Anything else
  is a `ValueError` saying it is neither. Parsing reads no cache and asks no hub.
- `local_dir(env)`: a directory as is. An id through `huggingface_hub.snapshot_download`,
  fetching only `ENGINE_FILES`: downloaded on first use where the hub is reachable, else read
  from the local cache. `env` (default `os.environ`, read at each call, since huggingface_hub
  reads its own settings once, at import) gives the cache, `HF_HUB_CACHE`, else
  `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; offline mode, `HF_HUB_OFFLINE=1`, where the
  hub is never asked; and `HF_TOKEN`, for gated and private repositories.
- An id that resolves to nothing raises `ModelNotFound` (a `FileNotFoundError`), which names the
  id, the revision, the cache directory, and whether the hub was asked (and its answer) or offline
  mode kept it from being asked. It is the user's to fix: callers print it, without a traceback.
- `pinned(local_dir)`: the same id at the commit `local_dir` holds, so every node of a deployment
  loads the snapshot the deploy step read, wherever `main` has moved since.
- `served_name`: the model's name for clients by default: the id without its revision, or the
  directory's name.

In a cluster every node resolves for itself: the Serve config carries the id, and the engine
replicas and the ingress call `local_dir()` in their constructors, on their own node, so no
shared filesystem is needed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

# What an engine and the ingress read from a checkpoint (`cairn/workers/model/loader.py`,
# `cairn/cluster/api/text_tokenizer.py`, `cairn/cluster/api/chat_template.py`); nothing else is downloaded.
ENGINE_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REVISION = re.compile(r"[^\s@]+")  # a branch (refs/pr/1 included), a tag or a commit
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelNotFound(FileNotFoundError):
    """A Hugging Face id that resolves to no checkpoint: not in the cache, and not from the hub."""


@dataclass(frozen=True)
class ModelSource:
    directory: Path | None = None  # absolute; None for a hub id
    repo_id: str | None = None     # org/name
    revision: str | None = None    # branch, tag or commit; None: the repository's default (main)

    @classmethod
    def parse(cls, text: str | Path) -> ModelSource:
        path = Path(text).expanduser()
        if path.is_dir():
            return cls(directory=path.resolve())
        repo_id, at, revision = str(text).partition("@")
        if at and not _REVISION.fullmatch(revision):
            raise ValueError(f"model {str(text)!r}: expected org/name@revision, a revision after the '@'")
        if repo_id.count("/") != 1 or not _valid_repo_id(repo_id):
            raise ValueError(f"model {str(text)!r} is neither a directory nor a Hugging Face id "
                             f"(org/name or org/name@revision)")
        return cls(repo_id=repo_id, revision=revision or None)

    def __str__(self) -> str:
        """What a Serve config carries: the absolute directory, or `org/name[@revision]`."""
        if self.directory is not None:
            return str(self.directory)
        return f"{self.repo_id}@{self.revision}" if self.revision else str(self.repo_id)

    @property
    def served_name(self) -> str:
        return self.directory.name if self.directory is not None else str(self.repo_id)

    def local_dir(self, env: Mapping[str, str] | None = None) -> Path:
        """The checkpoint directory on this node (see the module's contract)."""
        if self.directory is not None:
            return self.directory
        from huggingface_hub import snapshot_download

        env = os.environ if env is None else env
        cache, offline = hub_cache_dir(env), hub_offline(env)
        try:
            local = Path(snapshot_download(self.repo_id, revision=self.revision, cache_dir=cache,
                                           local_files_only=offline, allow_patterns=list(ENGINE_FILES),
                                           token=env.get("HF_TOKEN") or None))
        except OSError as e:  # every hub and cache miss of huggingface_hub is one
            raise ModelNotFound(self._not_found(cache, offline, e)) from None
        if not (local / "config.json").is_file():
            raise ModelNotFound(f"Hugging Face model {self.repo_id!r} (revision {self.revision or 'main'!r}): "
                                f"{local} has no config.json, so it is no checkpoint cairn can load")
        return local

    def pinned(self, local_dir: Path) -> ModelSource:
        """This id at the commit of `local_dir`, a snapshot of the cache (a directory: itself)."""
        local_dir = Path(local_dir)
        if self.repo_id is None or local_dir.parent.name != "snapshots" or not _COMMIT.fullmatch(local_dir.name):
            return self
        return replace(self, revision=local_dir.name)

    def _not_found(self, cache: Path, offline: bool, error: OSError) -> str:
        repo = cache / f"models--{self.repo_id.replace('/', '--')}"  # type: ignore[union-attr]
        where = (f"no snapshot in the cache {repo}" if repo.is_dir()
                 else f"not in the cache {cache} (no {repo.name})")
        hub = ("offline mode (HF_HUB_OFFLINE=1) kept the hub from being asked" if offline
               else f"the hub was asked and could not give it: {_first_line(error.__cause__ or error)}")
        return (f"Hugging Face model {self.repo_id!r} (revision {self.revision or 'main'!r}) not found, "
                f"nor a directory of that name: {where}; {hub}")


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache `env` names, as huggingface_hub derives it."""
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline(env: Mapping[str, str]) -> bool:
    """Whether the hub may not be asked: `env` says so, or huggingface_hub was imported offline
    (it then refuses every request whatever the environment says now)."""
    from huggingface_hub import constants

    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE or constants.HF_HUB_OFFLINE


def _valid_repo_id(repo_id: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else 'no message'}"
