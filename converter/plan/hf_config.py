"""A model's ``config.json``: found beside a source, or given as ``--config`` (a path or inline
JSON), read once and checked to be a JSON object. Export writes it into an HF output; export and
import read head counts (and ``tie_word_embeddings``) from it; from-universal checks a TP degree
against its head counts."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from formats.errors import ConfigError

CONFIG_FILE = "config.json"


def source_config(src: str | os.PathLike) -> Path | dict[str, Any] | None:
    """``src``'s own config.json (a local path, or parsed when ``src`` is a URL); None if absent."""
    from formats.storage import is_remote, open_storage

    if not is_remote(src):
        return Path(src) / CONFIG_FILE if (Path(src) / CONFIG_FILE).is_file() else None
    st = open_storage(src)
    if not st.exists(CONFIG_FILE):
        return None
    try:
        doc = json.loads(st.read_bytes(CONFIG_FILE))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{st.root / CONFIG_FILE}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{st.root / CONFIG_FILE}: config must be a JSON object")
    return doc


def load_config_arg(config: str | os.PathLike | Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, bytes | None]:
    """(parsed config, original file bytes) from a path, inline JSON text or a mapping."""
    if config is None:
        return None, None
    if isinstance(config, Mapping):
        return dict(config), None
    text = os.fspath(config)
    raw: bytes | None = None
    if text.lstrip().startswith("{"):
        where, body = "--config", text
    else:
        path = Path(text)
        if path.is_dir():
            path = path / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"--config {text!r}: no such file; pass a config.json path or inline JSON")
        raw = path.read_bytes()
        where, body = str(path), raw.decode("utf-8", errors="replace")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ConfigError(f"{where}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: config must be a JSON object")
    return doc, raw


def config_bytes(cfg: Mapping[str, Any]) -> bytes:
    """The config.json text ckptconv writes (sorted keys, two-space indent, final newline)."""
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8")
