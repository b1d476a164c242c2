"""Configuration of the engine simulator process: which simulated engines it serves.

``--engines`` is a JSON list (or a file holding one) of engine specs, the fields of
``SimSpec`` (simulator/engine.py)::

    [{"name": "fast", "prefill_ms": 15, "tpot_ms": 8, "batch_slowdown": 0.04, "max_running": 32},
     {"name": "weak", "prefill_ms": 10, "tpot_ms": 6, "batch_slowdown": 0.15, "max_running": 8, "count": 4}]

``count`` repeats a spec (names get -0, -1 ...). Each engine listens on its own port (any free
one); ``--ports-file`` receives {name: port} as JSON once all serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from benchmarks.gateway.simulator.engine import SimSpec
from services.common.settings import setting

SPEC_FIELDS = {f.name for f in fields(SimSpec)}


@dataclass
class SimulatorConfig:
    """tokenmill engine simulator: the Generation API over simulated engines with configured latency."""

    engines: str = setting("", env="TOKENMILL_SIM_ENGINES")
    """JSON list of engine specs, or the path of a file holding one (see the module's doc)."""
    host: str = setting("127.0.0.1", env="TOKENMILL_SIM_HOST")
    """Interface to listen on."""
    ports_file: str = setting("", env="TOKENMILL_SIM_PORTS_FILE", path=True)
    """Write {name: port} as JSON here once every engine serves."""
    http_ports_file: str = setting("", env="TOKENMILL_SIM_HTTP_PORTS_FILE", path=True)
    """Also serve each engine's OpenAI-compatible HTTP API (simulator/http_api.py) and write {name: http port} as JSON
    here."""
    profile_window_s: float = setting(60.0, env="TOKENMILL_SIM_PROFILE_WINDOW_S")
    """Default window of GetProfile, seconds."""
    log_level: str = setting("warning", env="TOKENMILL_SIM_LOG_LEVEL")
    """Least severe log level written."""

    def specs(self) -> list[SimSpec]:
        text = self.engines
        if text and not text.lstrip().startswith("["):
            text = Path(text).read_text(encoding="utf-8")
        try:
            items = json.loads(text) if text else []
        except json.JSONDecodeError as exc:
            raise ValueError(f"engines: not JSON: {exc}") from None
        if not isinstance(items, list) or not items:
            raise ValueError("engines: a non-empty JSON list of engine specs is required")
        specs = []
        for index, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ValueError(f"engines[{index}] must be an object with a name")
            count = item.pop("count", 1)
            unknown = set(item) - SPEC_FIELDS
            if unknown:
                raise ValueError(f"engines[{index}] has unknown fields {sorted(unknown)}")
            for k in range(count):
                name = item["name"] if count == 1 else f"{item['name']}-{k}"
                spec = SimSpec(**{**item, "name": name, "seed": item.get("seed", 0) + k})
                spec.validate()
                specs.append(spec)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"engines: names must be unique, got {names}")
        return specs

    def validate(self) -> None:
        self.specs()
