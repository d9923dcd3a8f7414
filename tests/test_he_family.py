"""The family and wide-values benchmarks of encrypted token models run end to end (real SEAL, a
real TenSEAL baseline) on MNIST-format files written here."""

from __future__ import annotations

import gzip
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _mnist_files(where: Path, seed: int) -> None:
    """MNIST-format test files of random images with a learnable pattern per class."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, 8010)
    images = rng.integers(0, 40, (8010, 28, 28))
    for k in range(10):
        images[labels == k, 2 * k:2 * k + 4, 4:24] = 255
    _write_idx(where / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(where / "t10k-labels-idx1-ubyte.gz", labels)


def _benchmark(name: str):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_family_benchmark_measures_a_model_against_the_recipe(tmp_path):
    _mnist_files(tmp_path, 0)
    bench = _benchmark("he_family")
    out = tmp_path / "family.json"
    res = bench.main(["--data-dir", str(tmp_path), "--quick", "--shipped-costs",
                      "--models", "p7_d32", "--precision-bits", "argmax",
                      "--output", str(out)])
    row = res["models"]["p7_d32"]
    assert row["within_promise"] and row["argmax_agreement"] == 1.0
    assert row["median_s"] > 0 and row["recipe_latency_s"] > 0
    assert row["speedup_vs_recipe"] == pytest.approx(row["recipe_latency_s"] / row["median_s"])
    assert json.loads(out.read_text())["summary"]["all_within_promise"]
    # the first image's steps timed beside their predictions, and where the server hoists,
    # its loops' block against 512 words on the same requests
    assert row["step_profile"]["rows"][0]["kind"] == "load"
    assert all(r["measured_s"] > 0 for r in row["step_profile"]["rows"])
    if "products_block_speedup" in row:
        assert row["products_block_speedup"] == pytest.approx(
            row["block512_server_median_s"] / row["block_server_median_s"])


def test_hoist_kernels_benchmark_times_each_block_on_the_same_operands(tmp_path):
    from he.hoist import expected
    if not expected():
        pytest.skip("no hoisting on this platform")
    bench = _benchmark("he_hoist_kernels")
    out = tmp_path / "kernels.json"
    res = bench.main(["--quick", "--blocks", "512,4096", "--output", str(out)])
    assert len(res["rows"]) == 2 and json.loads(out.read_text())["summary"]
    for row in res["rows"]:
        assert set(row["rotate_ext_ms"]) == {512, 4096} | {bench.hoist.PRODUCT_BLOCK}
        assert all(v > 0 for v in row["product_ms_per_term"].values())


def test_wide_values_benchmark_times_the_split_against_the_whole_ring(tmp_path):
    _mnist_files(tmp_path, 1)
    bench = _benchmark("he_wide_values")
    out = tmp_path / "wide.json"
    res = bench.main(["--data-dir", str(tmp_path), "--quick", "--shipped-costs",
                      "--models", "p2_d32", "--output", str(out)])
    row = res["models"]["p2_d32"]
    assert row["chosen"]["split"] and row["chosen"]["ring"] < row["whole"]["ring"]
    assert row["chosen"]["within_promise"] and row["whole"]["within_promise"]
    assert row["chosen_vs_whole"] == pytest.approx(row["whole_latency_s"] /
                                                   row["chosen"]["median_s"])
    assert json.loads(out.read_text())["summary"]["all_within_promise"]


def test_each_family_model_runs_in_a_process_of_its_own_and_a_dead_one_is_reported():
    import os

    bench = _benchmark("he_family")
    assert bench.isolated(lambda: {"pid": os.getpid()})["pid"] != os.getpid()
    with pytest.raises(bench.ProcessDied, match="exit code 9"):  # as a kill for memory leaves it
        bench.isolated(lambda: os._exit(9))
    with pytest.raises(RuntimeError, match="ValueError: bad model"):
        bench.isolated(lambda: (_ for _ in ()).throw(ValueError("bad model")))
    assert bench.isolated(lambda: {"after": True}) == {"after": True}


def test_planes_benchmark_toggles_one_server_and_restores_the_runtime(tmp_path):
    from he.plan import VectorPlan

    _mnist_files(tmp_path, 2)
    bench = _benchmark("he_planes_at_once")
    before = VectorPlan.concurrent_planes
    out = tmp_path / "planes.json"
    res = bench.main(["--data-dir", str(tmp_path), "--models", "conv_seq", "--epochs", "1",
                      "--requests", "4", "--output", str(out)])
    assert VectorPlan.concurrent_planes is before
    row = res["models"]["conv_seq"]
    assert row["max_abs_error_vs_simulation"] <= row["promised_error"]
    m, p = row["median_s"], row["predicted_s"]
    assert row["speedup"] == pytest.approx(m["in_turn"] / m["at_once"])
    # priced in turn, the planes steps cost their sum, more than their makespan on 2 threads
    if row["planes_steps"] >= 2 and row["server_threads"] >= 2:
        assert p["in_turn"] > p["at_once"]
    else:
        assert p["in_turn"] == pytest.approx(p["at_once"])
    assert json.loads(out.read_text())["models"]["conv_seq"] == json.loads(json.dumps(row))
    with pytest.raises(SystemExit, match="at least 4"):
        bench.main(["--requests", "3"])


def test_compile_cost_benchmark_compiles_here_and_in_a_baseline_checkout(tmp_path):
    bench = _benchmark("compile_cost")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cost.json"
    res = bench.main(["--models", "token1", "--baseline", str(root), "--output", str(out)])
    row = res["models"]["token1"]
    for side in ("this", "baseline"):
        # 3 levels with the embedding and the head on the server; the client applies both
        # (first_map and final_map "auto")
        assert row[side]["result"] == "1 levels, N=8192", row[side]
        assert row[side]["compile_s"] > 0 and row[side]["peak_rss_mib"] > 0
    assert row["speedup"] == pytest.approx(row["baseline"]["compile_s"] /
                                           row["this"]["compile_s"])
    assert json.loads(out.read_text())["models"]["token1"]["this"]["levels"] == 1
    with pytest.raises(SystemExit, match="not a checkout"):
        bench.main(["--models", "token1", "--baseline", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown models"):
        bench.main(["--models", "nope"])


def test_pricing_benchmark_sets_two_tables_side_by_side(tmp_path):
    """The same table on both sides: the same plan, the same prediction, each server timed."""
    _mnist_files(tmp_path, 2)
    bench = _benchmark("he_pricing")
    table = Path(bench.costmodel.__file__).with_name("cost_table.json")
    out = tmp_path / "pricing.json"
    res = bench.main(["--data-dir", str(tmp_path), "--against", str(table), "--models",
                      "p7_d32", "--rounds", "2", "--output", str(out)])
    row = res["models"]["p7_d32"]
    assert row["same_plan"]
    assert row["shipped"]["predicted_s"] == pytest.approx(row["against"]["predicted_s"])
    assert row["shipped"]["measured_s"] > 0 and row["against"]["measured_s"] > 0
    assert row["shipped"]["machine_drift"] == row["against"]["machine_drift"] > 0
    assert json.loads(out.read_text())["against_prediction_errors"]["models"] == 1


def test_pricing_benchmark_refuses_a_file_that_is_not_a_cost_table(tmp_path):
    bad = tmp_path / "table.json"
    bad.write_text('{"table": 3}')
    with pytest.raises(SystemExit, match="not a cost table"):
        _benchmark("he_pricing").main(["--against", str(bad)])
