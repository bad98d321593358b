"""The arrows run one way.

- synth is the engine: it never imports the server side, asyncio or web frameworks; the scheduler no torch, and
  the engine's step loop none either (the runner owns the tensors: `T3Runner.execute(plan)`).
- agent_server is a house of floors (docs/architecture.md): a module imports only its own room and the floors
  below it, never a room beside it. Every module of agent_server stands in a room of FLOORS.
- A protocol gets the port (core/port.py), never the hub: nothing in protocols/ imports core/hub.py or reaches
  for a `hub` attribute.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_SYNTH = {"agent_server", "asyncio", "starlette", "uvicorn", "websockets"}
AGENT_SERVER = ROOT / "agent_server"
# room (a subpackage, or a module of agent_server/ itself) -> its floor; a room imports only from lower floors
FLOORS = {
    "cli": 8,  # the command: flags, logging, the server
    "app": 7,  # the Starlette app: routes, lifespan
    "metrics": 6,  # Prometheus, the dashboard and demo pages: an observer of the hub
    "jobs": 5,  # long texts behind 202 Accepted: records, stores, the runner, their HTTP API (native request shape)
    "protocols": 4,  # native and every vendor's wire format, HTTP on its one base, gRPC's Riva
    "core": 3,  # session, transports, hub, stream, events, outcomes, port, voices
    "fleet": 2,  # shared state, auth, keys, agent check, phrase cache, replica metrics
    "text": 2,  # segmenter, markup, normalisation, timestamps
    "audio": 2,  # formats, resampling, codecs, the encode lane
    "settings": 1,  # the ground: what every floor may read
    "errors": 1,
    "logging": 1,
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _agent_server_imports(path: Path) -> set[str]:
    """The agent_server modules `path` imports, dotted ("agent_server.core.hub"), TYPE_CHECKING ones too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] == "agent_server")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "agent_server":  # `from agent_server import metrics`
                names.update(f"agent_server.{alias.name}" for alias in node.names)
            elif node.module.startswith("agent_server."):
                names.add(node.module)
    return names


def _room(dotted: str) -> str:
    return dotted.split(".")[1]


def _server_modules() -> list[Path]:
    return sorted(p for p in AGENT_SERVER.rglob("*.py") if p.name != "__init__.py" or p.parent != AGENT_SERVER)


def test_synth_never_imports_the_server_side() -> None:
    files = sorted((ROOT / "synth").glob("*.py"))
    assert files
    for path in files:
        bad = _imported_modules(path) & FORBIDDEN_IN_SYNTH
        assert not bad, f"{path.name} imports {bad}"


def test_scheduler_is_policy_only() -> None:
    for name in ("scheduler.py", "request.py", "api.py", "rows.py"):
        assert "torch" not in _imported_modules(ROOT / "synth" / name), name


def test_the_engine_imports_no_torch() -> None:
    """synth/engine.py keeps the inbox, the scheduling, the hand-off and the emits; tensors live behind the runner
    (synth/t3_runner.py), the vocoder and synth/build.py."""
    imported = _imported_modules(ROOT / "synth" / "engine.py")
    assert "torch" not in imported and "numpy" not in imported, imported & {"torch", "numpy"}
    assert "synth" in imported  # the parse saw its imports


def test_every_module_of_the_server_stands_in_a_room() -> None:
    rooms = {p.relative_to(AGENT_SERVER).parts[0].removesuffix(".py") for p in _server_modules()}
    assert rooms <= set(FLOORS), f"give {sorted(rooms - set(FLOORS))} a floor in FLOORS (docs/architecture.md)"


def test_the_server_imports_run_down_the_floors() -> None:
    wrong: list[str] = []
    for path in _server_modules():
        mine = path.relative_to(AGENT_SERVER).parts[0].removesuffix(".py")
        for target in _agent_server_imports(path):
            theirs = _room(target)
            if theirs != mine and FLOORS[theirs] >= FLOORS[mine]:
                wrong.append(f"{path.relative_to(ROOT)} ({mine}, floor {FLOORS[mine]}) imports {target} "
                             f"({theirs}, floor {FLOORS[theirs]})")
    assert not wrong, "\n".join(wrong)


def test_protocols_get_the_port_never_the_hub() -> None:
    wrong: list[str] = []
    for path in sorted((AGENT_SERVER / "protocols").rglob("*.py")):
        if "agent_server.core.hub" in _agent_server_imports(path):
            wrong.append(f"{path.name} imports agent_server.core.hub")
        tree = ast.parse(path.read_text())
        wrong.extend(f"{path.name}:{node.lineno} reaches for .{node.attr}" for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and node.attr in ("hub", "_hub"))
    assert not wrong, "\n".join(wrong)
