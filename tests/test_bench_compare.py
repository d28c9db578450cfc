"""benchmarks/bench_compare.py (``nox -s bench-compare``): the comparison, its failure
threshold and the base/head alternation, without a database (measurements are faked)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    path = ROOT / "benchmarks" / "bench_compare.py"
    spec = importlib.util.spec_from_file_location("bench_compare", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_compare"] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_a_median_more_than_the_threshold_slower_regresses() -> None:
    base = {"process": [10_000.0, 10_000.0, 10_000.0]}
    # exactly 10% slower is allowed; anything beyond is not
    (at_limit,) = bench.compare(base, {"process": [9_000.0] * 3}, threshold=0.10)
    (beyond,) = bench.compare(base, {"process": [8_999.0] * 3}, threshold=0.10)
    assert not at_limit.regressed
    assert at_limit.ratio == pytest.approx(0.9)
    assert beyond.regressed


def test_medians_are_compared_so_one_outlier_does_not_decide() -> None:
    base = {"process": [10_000.0, 10_100.0, 2_000.0], "enqueue": [50_000.0, 49_000.0, 51_000.0]}
    head = {"process": [9_900.0, 30_000.0, 9_950.0], "enqueue": [20_000.0, 30_000.0, 90_000.0]}
    rows = {r.metric: r for r in bench.compare(base, head, threshold=0.10)}
    assert rows["process"].base == 10_000.0
    assert rows["process"].head == 9_950.0
    assert not rows["process"].regressed
    assert rows["enqueue"].head == 30_000.0
    assert rows["enqueue"].regressed  # 0.6x of 50,000


def test_faster_is_never_a_regression_and_one_sided_metrics_are_left_out() -> None:
    rows = bench.compare(
        {"process": [1.0], "only_base": [5.0]},
        {"process": [3.0], "only_head": [5.0]},
        threshold=0.0,
    )
    assert [(r.metric, r.ratio, r.regressed) for r in rows] == [("process", 3.0, False)]


@pytest.mark.parametrize("threshold", [-0.1, 1.0, 2.0])
def test_a_threshold_outside_zero_to_one_is_refused(threshold: float) -> None:
    with pytest.raises(ValueError, match="threshold"):
        bench.compare({"p": [1.0]}, {"p": [1.0]}, threshold=threshold)


def test_missing_samples_or_a_zero_base_are_refused() -> None:
    with pytest.raises(ValueError, match="no samples"):
        bench.compare({"p": []}, {"p": [1.0]})
    with pytest.raises(ValueError, match="not positive"):
        bench.compare({"p": [0.0]}, {"p": [1.0]})


@pytest.mark.parametrize(
    ("head_rate", "status"), [(9_500.0, 0), (8_000.0, 1)], ids=["within", "regressed"]
)
def test_runs_alternate_base_and_head_and_a_regression_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    head_rate: float,
    status: int,
) -> None:
    calls: list[str] = []

    def fake_run(python: str, dsn: str, schema: str, n: int, server_cpu: bool) -> dict[str, float]:
        calls.append(python)
        assert n == 123
        return {"process": 10_000.0 if python == "base-py" else head_rate}

    monkeypatch.setattr(bench, "_run_one", fake_run)
    argv = ["--dsn", "postgresql://x@127.0.0.1/db", "--base-python", "base-py"]
    argv += ["--head-python", "head-py", "--rounds", "3", "--n", "123"]
    assert bench.main(argv) == status
    assert calls == ["base-py", "head-py"] * 3
    out = capsys.readouterr().out
    assert ("REGRESSED" in out) == (status == 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["--dsn", "postgresql://x@127.0.0.1/db"],  # no base build
        ["--base-python", "p", "--rounds", "0"],
        ["--base-python", "p", "--n", "0"],
    ],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2


def test_only_gated_metrics_fail_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(python: str, dsn: str, schema: str, n: int, server_cpu: bool) -> dict[str, float]:
        base = python == "base-py"
        return {"process": 10_000.0 if base else 5_000.0, "process_cpu": 30_000.0}

    monkeypatch.setattr(bench, "_run_one", fake_run)
    argv = ["--dsn", "postgresql://x@127.0.0.1/db", "--base-python", "base-py", "--rounds", "1"]
    assert bench.main([*argv, "--gate", "process_cpu"]) == 0
    assert bench.main([*argv, "--gate", "process_cpu", "--gate", "process"]) == 1
    assert bench.main(argv) == 1


def test_server_cpu_counts_the_parent_its_children_and_those_it_reaped() -> None:
    # This process stands in for the postmaster: a child that burns CPU and exits (reaped
    # by subprocess.run) must show up in the total, as a finished backend does.
    before = bench._server_cpu_seconds(os.getpid())
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=120)
    after = bench._server_cpu_seconds(os.getpid())
    assert after - before >= 0.25
    assert int(bench._proc_stat(os.getpid())[1]) == os.getppid()


def test_enqueue_cpu_reads_a_backend_on_this_machine_and_none_elsewhere() -> None:
    # This process stands in for the backend: the CPU it burns shows in the reading.
    before = bench._backend_cpu(os.getpid())
    assert before is not None
    start = time.process_time()
    while time.process_time() - start < 0.3:  # CPU time, not a wait
        pass
    after = bench._backend_cpu(os.getpid())
    assert after is not None
    assert after - before >= 0.25
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    assert bench._backend_cpu(reaped.pid) is None  # no such process: as on another machine


def test_measurements_cache_bytecode_and_see_no_other_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, str] = {}

    def fake_run(
        cmd: list[str], *, env: dict[str, str], **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 0, '{"enqueue": 1.0}\n', "")

    for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "VIRTUAL_ENV"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("STEEPLE_TEST_DSN", "kept")
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench._run_one("py", "dsn", "schema", 1, False) == {"enqueue": 1.0}
    assert seen["STEEPLE_TEST_DSN"] == "kept"
    assert not {"PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "VIRTUAL_ENV"} & seen.keys()
