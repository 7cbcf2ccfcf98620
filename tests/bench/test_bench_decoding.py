"""``bench/bench_decoding.py`` and ``bench/host_profile.py`` on the CPU: the JSON rows of both
models, and ``--profile``'s functions, per token, the time of LIMe's own decoding branch among
LIMe's differences and the generation loop at the top of the baseline's."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

from tests.bench import load_bench

*_, host_profile, decoding = load_bench("tables", "cpu_triton", "bench_lime_overhead", "host_profile", "bench_decoding")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

TINY = "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --kv-heads 2 --ffn-hidden-size 64 --vocab-size 64"


def test_function_times_and_differences_per_call():
    def slow():
        time.sleep(0.02)

    def fast():
        pass

    def lime():
        for _ in range(4):
            slow()
        fast()

    def base():
        slow()
        fast()

    lime_times, base_times = host_profile.function_times(lime), host_profile.function_times(base)
    [slow_name] = [name for name in lime_times if name.endswith("(slow)")]
    assert "test_bench_decoding.py" in slow_name and lime_times[slow_name][2] == 4
    entries = host_profile.function_differences(lime_times, base_times, top=3, per=2.0)
    # lime itself first, then slow and the sleep inside it, whose difference is slow's within the
    # timer's noise (either may come first)
    names = [entry["name"].split("(")[-1] for entry in entries]
    assert names[0] == "lime)" and set(names[1:]) == {"slow)", "<built-in method time.sleep>"}, names
    by_name = {entry["name"]: entry for entry in entries}
    assert by_name[slow_name]["lime_calls"] == 2.0 and by_name[slow_name]["base_calls"] == 0.5
    assert by_name[slow_name]["diff_ms"] == pytest.approx(30, abs=8)  # 3 more sleeps of 20 ms, per 2
    top_base = host_profile.function_differences(lime_times, base_times, top=2, by="base_ms")
    assert all(entry["base_ms"] > 15 for entry in top_base)


def test_profiled_run_writes_rates_and_functions(tmp_path):
    path = tmp_path / "decoding.json"
    printed = io.StringIO()
    argv = [*TINY.split(), "--new-tokens", "4", "--prompt-length", "4", "--repeats", "1", "--profile", "40"]
    with contextlib.redirect_stdout(printed):
        decoding.main([*argv, "--json", str(path)])
    document = json.loads(path.read_text())
    assert [row["model"] for row in document["rows"]] == ["LIMe", "baseline"]
    assert all(row["same_tokens"] and row["cached_tokens_per_s"] > 0 for row in document["rows"])
    profile = document["profile"]
    assert "device_ms_per_token" not in profile  # a CPU: no kernels to profile
    assert len(profile["functions"]) == len(profile["functions_base"]) == 40
    # by LIMe's extra time, its own decoding attention among them (first on an idle machine; a busy
    # one's timer noise may rank a shared function above it)
    functions = profile["functions"]
    assert [entry["diff_ms"] for entry in functions] == sorted((entry["diff_ms"] for entry in functions), reverse=True)
    [attention] = [entry for entry in functions if "_decoding_forward" in entry["name"]]
    assert attention["lime_calls"] > 0 and attention["base_calls"] == 0 and attention["diff_ms"] > 0
    # megatron's own attention, which LIMe's replaces, among what the baseline spends most in
    # (Python 3.12's profiler does not see the generation loop around the layers: host_profile)
    base = profile["functions_base"]
    assert [entry["base_ms"] for entry in base] == sorted((entry["base_ms"] for entry in base), reverse=True)
    assert any(
        entry["name"].startswith("transformer/attention.py") and entry["lime_calls"] == 0 < entry["base_calls"]
        for entry in base
    )
    assert "ms a KV-cache token" in printed.getvalue() and "most LIMe - baseline" in printed.getvalue()
