"""synth is the engine: it never imports the server side, asyncio or web frameworks; the scheduler no torch, and
the engine's step loop none either (the runner owns the tensors: `T3Runner.execute(plan)`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_SYNTH = {"agent_server", "asyncio", "starlette", "uvicorn", "websockets"}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


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
