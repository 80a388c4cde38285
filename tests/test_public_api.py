"""The public API is what users call: each subpackage's ``__all__`` is the list below, each name documented, and
the API reference in docs/api/ shows exactly these names (built here with mkdocs, as CI builds it)."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PUBLIC: dict[str, list[str]] = {
    "schedule": [
        "Action", "Kind", "Schedule", "ScheduleError", "ScheduleName", "SharedCores", "SimulationResult", "StageCosts",
        "build", "holdings", "peak_in_flight", "render", "simulate", "synthesise", "to_chrome_trace", "validate",
    ],
    "partition": [
        "By", "CapacityError", "CaptureError", "CapturedChain", "Layer", "LayerCost", "MemoryModel", "MemorySetting",
        "Partition", "Tie", "auto", "balance", "balance_costs", "capture", "layers_of", "memory_model", "profile",
        "shared_parameters",
    ],
    "comm": [
        "CommError", "CommTimeoutError", "LaunchError", "LaunchOptions", "Layout", "PeerGoneError", "PipelineMesh",
        "Transport", "init_mesh", "launch",
    ],
    "pipeline": [
        "Batch", "BatchNormStatistics", "Compute", "DataParallel", "Diagnostics", "FullySharded", "Initialiser",
        "LoaderOptions", "Loss", "LossFn", "LossReduction", "NonFinite", "NonFiniteLossError", "Pipeline",
        "PipelineOptions", "PretrainedError", "SelectiveCheckpointing", "StageError", "StageLoader",
        "TensorParallelPlan", "WeightGradientFusion", "from_torch", "load_pretrained", "materialise_model",
        "to_torch", "torch_pipe", "torch_runtime", "torch_stages",
    ],
    "checkpoint": [
        "CheckpointError", "Checkpointer", "Choice", "ExportFormat", "Progress", "Refused", "choose", "export",
        "latest", "load", "progress_of", "save", "verify",
    ],
    "plan": ["Cluster", "Device", "Option", "Plan", "Workload", "evaluate", "plan", "workload"],
    "models": [
        "GPT", "PRESETS", "CNNConfig", "GPTConfig", "MLPConfig", "ModelConfig", "MoEConfig", "ResidualMLP", "SmallCNN",
        "build", "preset",
    ],
    "run": ["Optimizer", "Summary", "TrainConfig", "build_pipeline", "train"],
}  # fmt: skip
"""What users call from each subpackage: the names the README and docs/ import, and the types those take and
return. Everything else is importable from the module that defines it."""

DOCUMENTED_MODULES = {"models": {"gpt_parallel", "moe"}}
"""Modules the API reference documents on a package's page besides its names (GPT's tensor-parallel plan, the
mixture-of-experts layer)."""


def test_each_subpackage_exports_what_users_call_each_with_a_docstring() -> None:
    for package, names in PUBLIC.items():
        module = importlib.import_module(f"stagewise.{package}")
        assert sorted(module.__all__) == sorted(names), package
        for name in names:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                assert (value.__doc__ or "").strip(), f"stagewise.{package}.{name} has no docstring"
    import stagewise

    assert set(stagewise.__all__) - {"__version__"} == {
        "LayerCost", "Partition", "Pipeline", "StagewiseError", "auto", "balance", "comm", "layers_of", "models",
        "partition", "pipeline", "profile", "schedule",
    }  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the API reference is built with the docs extra (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    return out


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_the_api_reference_shows_exactly_the_public_names(package: str, site: Path) -> None:
    html = (site / "api" / package / "index.html").read_text()
    # A name whose module shares it (stagewise.partition.auto.auto) has a block of its own.
    shown = set(re.findall(rf'id="stagewise\.{package}\.(\w+)"', html))
    shown |= {a for a, b in re.findall(rf'id="stagewise\.{package}\.(\w+)\.(\w+)"', html) if a == b}
    assert shown == set(PUBLIC[package]) | DOCUMENTED_MODULES.get(package, set())


def test_no_public_name_is_taken_by_a_module_of_the_same_name() -> None:
    # A package that loads its names lazily would hand out its submodule `balance` for the function `balance`
    # once that submodule is imported: with every module imported, each name is still the function or class.
    import pkgutil

    import stagewise

    for info in pkgutil.walk_packages(stagewise.__path__, "stagewise."):
        if info.name != "stagewise.__main__":
            importlib.import_module(info.name)
    for package, names in PUBLIC.items():
        module = importlib.import_module(f"stagewise.{package}")
        for name in names:
            assert not inspect.ismodule(getattr(module, name)), f"stagewise.{package}.{name} is a module"
