"""Who may load an adapter at runtime, and from where (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
gate, made finer).

- With `--lora-root` directories, only a path inside one of them loads, with or without a key.
- Without any, loading needs `--api-key` (then every path loads, as the engine can read it).
- Otherwise runtime loading is off, and so is unloading: an adapter unloaded then could not
  come back without a restart. Unloading is open wherever loading is (any name, any caller that
  passes the key check).

A refusal (403) comes before the engine touches the path, so a caller learns nothing about the
files outside the roots: a path that is not inside a root once made absolute and normalized
(`..` folded, no filesystem access) is refused as it is; one that is, is then resolved (its
symlinks followed) and refused if that leads out of every root. The engine loads the resolved
path, the one that was checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moelora.server.errors import PermissionDeniedError


@dataclass(frozen=True)
class LoraGate:
    roots: tuple[Path, ...]  # resolved
    has_api_key: bool

    @classmethod
    def of(cls, roots: tuple[Path | str, ...], *, has_api_key: bool) -> LoraGate:
        return cls(tuple(Path(root).resolve() for root in roots), has_api_key)

    @property
    def may_refuse(self) -> bool:
        return bool(self.roots) or not self.has_api_key

    @property
    def updates_off(self) -> bool:
        return not self.roots and not self.has_api_key

    def allowed_path(self, path: str) -> str:
        """The path the engine may load for `path`; raises PermissionDeniedError (403)."""
        self._check_updates("loading")
        if not self.roots:
            return path
        normalized = Path(os.path.abspath(path))
        if not self._inside_a_root(normalized):
            raise self._outside(path, "")
        try:
            resolved = normalized.resolve()
        except (OSError, RuntimeError):  # a symlink loop
            raise self._outside(path, " once its symlinks are followed") from None
        if not self._inside_a_root(resolved):
            raise self._outside(path, " once its symlinks are followed")
        return str(resolved)

    def check_unload(self) -> None:
        """Raises PermissionDeniedError (403) where runtime updates are off."""
        self._check_updates("unloading")

    def _check_updates(self, what: str) -> None:
        if self.updates_off:
            raise PermissionDeniedError(
                f"{what} adapters at runtime is off: start the server with --lora-root DIR "
                "to allow adapters inside DIR, or with --api-key KEY to allow callers "
                "that send the key"
            )

    def _inside_a_root(self, path: Path) -> bool:
        return any(path.is_relative_to(root) for root in self.roots)

    def _outside(self, path: str, how: str) -> PermissionDeniedError:
        roots = ", ".join(repr(str(root)) for root in self.roots)
        return PermissionDeniedError(
            f"lora_path {path!r} is outside the --lora-root directories{how}: expected a path "
            f"inside {roots}"
        )
