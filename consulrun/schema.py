"""The manifest's JSON Schema, loaded without the validator so light commands stay fast to start."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

SCHEMA: dict[str, Any] = json.loads(resources.files("consulrun").joinpath("manifest.schema.json").read_text())


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a job name (unit-name and KV-key material), or None if it can."""
    rule = SCHEMA["$defs"]["name"]
    return None if re.fullmatch(rule["pattern"], name) else f"job name {name!r} {rule['x-message']}"
