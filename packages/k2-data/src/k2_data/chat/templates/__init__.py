"""Moonshot's released Kimi K2 chat templates, stored verbatim, with where each copy came from.

`provenance.json` names, per template, the public repository, path and commit the file was taken from and
its sha256. The Python renderers in `k2_data.chat.released` reproduce these files byte for byte (the
tests render both through transformers and compare); `k2 export` can write one of them as the exported
model's chat template.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

_DIR = Path(__file__).parent


@cache
def template_provenance() -> dict[str, dict[str, str]]:
    """`{template name: {"file", "upstream", "repo", "path", "commit", "sha256", "note"}}`."""
    return json.loads((_DIR / "provenance.json").read_text(encoding="utf-8"))


def released_template_text(name: str) -> str:
    """The Jinja source of a released template, by its name (`kimi-k2-instruct-0905`, `kimi-k2-thinking`)."""
    prov = template_provenance()
    if name not in prov:
        raise ValueError(f"no released chat template named {name!r} (known: {', '.join(sorted(prov))})")
    return (_DIR / prov[name]["file"]).read_text(encoding="utf-8")
