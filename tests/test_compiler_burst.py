"""A real compiler burst: a fake VLLM::EngineCore runs ninja -> nvcc (-gencode arch=compute_121a,code=sm_121a) into a
flashinfer-shaped cache, and the telemetry follows it: census, arch, engine, MAX_JOBS, progress, compiling -> idle,
and a stuck engine -> stalled."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from sparkwatch.config.settings import load_settings
from sparkwatch.core.engines.jit import JitParams
from sparkwatch.core.model import Event, Snapshot
from sparkwatch.telemetry.loop import Telemetry, TelemetryLoop
from tests.conftest import Spawner, require_tool, wait_until

JIT_ENGINE = Path(__file__).parent / "helpers" / "jit_engine.py"
SOURCES = 4
JOBS = 2

# Small, but with enough unrolled code that ptxas runs ~150 ms per file: long enough to be seen at a 50 ms sampling.
KERNEL = """
__global__ void k{i}(float* x, const float* y, int n) {{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    float a = x[t], b = y[t];
    #pragma unroll
    for (int j = 0; j < 3000; ++j) {{ a = a * b + (float)j * 0.{i}5f; b = b * a - 1.25f; }}
    x[t] = a + b;
}}
"""


def write_build(module_dir: Path, nvcc: str) -> None:
    """A build.ninja shaped like flashinfer's: one cuda_compile per source, then a link to <module>.so."""
    module_dir.mkdir(parents=True)
    src = module_dir.parent.parent / "src"
    src.mkdir(exist_ok=True)
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {nvcc}",
        "cuda_cflags = -gencode=arch=compute_121a,code=sm_121a -Xcompiler -fPIC -O2",
        "rule cuda_compile",
        "  command = $nvcc $cuda_cflags -c $in -o $out",
        "rule link",
        "  command = $nvcc -shared $in -o $out",
        "",
    ]
    objects = []
    for i in range(SOURCES):
        (src / f"k{i}.cu").write_text(KERNEL.format(i=i))
        lines.append(f"build k{i}.cuda.o: cuda_compile {src / f'k{i}.cu'}")
        objects.append(f"k{i}.cuda.o")
    lines.append(f"build {module_dir.name}.so: link {' '.join(objects)}")
    (module_dir / "build.ninja").write_text("\n".join(lines) + "\n")


def test_real_compiler_burst(spawner: Spawner, tmp_path: Path) -> None:
    nvcc = require_tool("nvcc")
    require_tool("ninja")
    base = tmp_path / "home" / ".cache" / "flashinfer"
    module = base / "0.4.1" / "121a" / "cached_ops" / "sw_test_kernels"
    write_build(module, nvcc)
    settings = load_settings(
        None,
        {
            "ancestor_pid": os.getpid(),
            "jit_cache_dirs": [base],
            "vllm_cache_dirs": [tmp_path / "none"],
            "compile_jobs_alert": 1,  # 2 nvcc + 2 cicc exceed it: the "wide" reason fires too
            "state_dir": tmp_path / "state",
        },
    )
    events: list[Event] = []
    loop = TelemetryLoop(Telemetry(settings), 0.05, on_event=events.append)
    marker = tmp_path / "stall-now"
    engine = spawner.popen([sys.executable, str(JIT_ENGINE), str(module), str(JOBS), str(marker)])
    snaps: list[Snapshot] = []
    deadline = time.monotonic() + 90
    while not (module / "ninja.rc").exists():
        assert time.monotonic() < deadline, "the build did not finish"
        snaps.append(loop.run_once())
        time.sleep(0.05)
    rc, _, output = (module / "ninja.rc").read_text().partition("\n")
    assert rc == "0", output

    census = [s.compile for s in snaps if s.compile is not None]
    # Other people's compilers may run on this machine too: count what is in this engine's tree.
    mine = [e for c in census for e in c.engines if e.root_pid == engine.pid]
    assert mine and all(e.kind == "vllm" for e in mine)
    peak = {tool: max(e.tools.get(tool, 0) for e in mine) for tool in ("nvcc", "cicc", "ptxas", "ninja")}
    assert peak["ninja"] == 1
    assert 1 <= peak["nvcc"] <= JOBS  # ninja -j 2: two at most (a child caught mid-exec is no third: compile.py)
    assert peak["cicc"] >= 1 and peak["ptxas"] >= 1
    assert all(e.max_jobs_state == "unset" for e in mine if e.tools)
    assert any(c.archs.get("121a", 0) >= 1 for c in census)
    # progress: from some objects missing to all of them, and the module linked
    jits = [s.jit[0] for s in snaps if s.jit]
    assert all(j.objects_total == SOURCES for j in jits)
    assert min(j.objects_done for j in jits) < SOURCES
    states = [st.state for s in snaps for st in s.jit_states if st.root_pid == engine.pid]
    assert "compiling" in states

    # idle once it finished: no compiler, no growth, the engine sleeping (not in a pipe)
    def state_now() -> str:
        snap = loop.run_once()
        (st,) = [st for st in snap.jit_states if st.root_pid == engine.pid]
        return st.state

    assert wait_until(lambda: state_now() == "idle", 20, 0.25)
    final = loop.latest
    assert final is not None and final.jit[0].objects_done == SOURCES and final.jit[0].modules_built == 1
    assert final.compile is not None
    assert [e.tools for e in final.compile.engines if e.root_pid == engine.pid] == [{}]

    # The burst is said once, not once a second (someone else's compilers on this machine may have opened a burst of
    # their own just before: at most two), and this engine is named once for compiling without MAX_JOBS.
    bursts = [e for e in events if e.kind == "compile_burst"]
    assert 1 <= len(bursts) <= 2, [e.summary for e in bursts]
    missing = [e for e in events if e.kind == "max_jobs_missing"]
    assert [e.fields["root_pid"] for e in missing] == [engine.pid], [e.summary for e in missing]
    assert missing[0].fields["engine"] == "vllm" and missing[0].fields["max_jobs_source"] == "compiler"
    assert "MAX_JOBS=4" in missing[0].summary

    # and now it gets stuck: the engine blocks on a pipe with no compiler left to write to it
    loop.telemetry.jit_params = JitParams(stall_s=1.0, settle_s=1.0)
    marker.write_text("")
    assert wait_until(lambda: state_now() == "stalled", 15, 0.25)
    stalled = [e for e in events if e.kind == "jit_stalled"]
    assert len(stalled) == 1 and stalled[0].fields["root_pid"] == engine.pid
