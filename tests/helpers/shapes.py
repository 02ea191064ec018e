"""Install engines under their real names, and describe process trees shaped as the engines' own sources shape them.

`ShapeKit(tmp)` lays out, in a temporary prefix:
- console scripts with a Python shebang, as pip installs them (`venv/bin/vllm`, `sglang`, `trtllm-serve`, …): the
  kernel runs them as `python /…/venv/bin/vllm serve m`, exactly like the real ones;
- modules for `python -m` (`vllm.entrypoints.openai.api_server`, `sglang.launch_server`, `llama_cpp.server`,
  `tensorrt_llm.llmapi.mgmn_worker_node`, …) on a PYTHONPATH;
- a tiny C program (built with cc) copied under binary names (`llama-server`, `rpc-server`, `ollama`,
  `ollama_llama_server`): a real ELF whose comm and exe are those names. It starts one child from SHAPE_CHILD_ARGV
  (fields separated by \\x1f) and pauses;
- shared objects named like the engines' native modules (`tensorrt_llm/libs/libtensorrt_llm.so`,
  `vllm/_C.abi3.so`, `sgl_kernel/common_ops.abi3.so`), built with cc: what an engine's own process maps.
Every Python process runs tests/helpers/shape_proc.py, which takes its title, children and library from the env.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HELPERS = Path(__file__).resolve().parent

SLEEPER_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(void) {
    char *spec = getenv("SHAPE_CHILD_ARGV");
    if (spec && *spec) {
        char *buf = strdup(spec), *argv[64];
        int n = 0;
        for (char *t = strtok(buf, "\x1f"); t && n < 63; t = strtok(NULL, "\x1f")) argv[n++] = t;
        argv[n] = NULL;
        unsetenv("SHAPE_CHILD_ARGV");
        if (fork() == 0) { execv(argv[0], argv); _exit(127); }
    }
    for (;;) pause();
}
"""

LIB_C = "int sparkwatch_shape_marker(void) { return 42; }\n"

CONSOLE_SCRIPTS = ("vllm", "sglang", "trtllm-serve", "trtllm-bench", "pip")
MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.cli.main",
    "sglang.launch_server",
    "sglang.bench_serving",
    "sglang.multimodal_gen.runtime.entrypoints.cli.main",
    "llama_cpp.server.__main__",
    "tensorrt_llm.commands.serve",
    "tensorrt_llm.llmapi.mgmn_worker_node",
    "tensorrt_llm.llmapi.mgmn_leader_node",
)
BINARIES = (
    "build/bin/llama-server",
    "build/bin/llama-cli",
    "build/bin/rpc-server",
    "usr/local/bin/ollama",
    "usr/local/lib/ollama/llama-server",
    "tmp/ollama123/runners/cuda_v12/ollama_llama_server",
    "bin/sshd",  # a user's copy named like a system daemon: judged like any other process
)

RUN_HELPER = f"import sys; sys.path.insert(0, {str(HELPERS)!r}); from shape_proc import main; main()"


class ShapeKit:
    def __init__(self, root: Path, build: bool = True) -> None:
        self.root = root
        self.python = sys.executable
        self.pkgs = root / "pkgs"
        self.trtllm_lib = root / "site-packages/tensorrt_llm/libs/libtensorrt_llm.so"
        self.vllm_lib = root / "site-packages/vllm/_C.abi3.so"  # vLLM's _C extension (vllm/platforms/cuda.py)
        self.sgl_lib = root / "site-packages/sgl_kernel/common_ops.abi3.so"
        if build:
            self._build()

    def _build(self) -> None:
        root = self.root
        cc = shutil.which("cc")
        if cc is None:
            raise RuntimeError("cc is needed to build the binary shapes")
        sleeper = root / "sleeper"
        src = root / "sleeper.c"
        src.write_text(SLEEPER_C)
        subprocess.run([cc, "-O1", "-o", str(sleeper), str(src)], check=True)
        for rel in BINARIES:
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(sleeper, dest)
        libsrc = root / "lib.c"
        libsrc.write_text(LIB_C)
        for lib in (self.trtllm_lib, self.vllm_lib, self.sgl_lib):
            lib.parent.mkdir(parents=True)
            subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(libsrc)], check=True)
        for name in CONSOLE_SCRIPTS:
            script = self.bin(name)
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(f"#!{self.python}\n{RUN_HELPER}\n")
            script.chmod(0o755)
        for module in MODULES:
            parts = module.split(".")
            for i in range(1, len(parts)):
                pkg = self.pkgs.joinpath(*parts[:i])
                pkg.mkdir(parents=True, exist_ok=True)
                (pkg / "__init__.py").touch()
            self.pkgs.joinpath(*parts[:-1], parts[-1] + ".py").write_text(RUN_HELPER + "\n")

    def bin(self, name: str) -> Path:
        return self.root / "venv" / "bin" / name

    def binary(self, rel: str) -> str:
        return str(self.root / rel)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.pkgs)}


@dataclass
class Node:
    """One process. `argv` is what is exec'd; `expect` is "root:<kind>", "member" or "spared"."""

    argv: list[str]
    expect: str
    title: str = ""
    comm: str = ""
    lib: str = ""
    children: list[Node] = field(default_factory=list)
    shebang: str = ""  # set for console scripts: the kernel puts the interpreter first

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.title:
            env["SHAPE_TITLE"] = self.title
        if self.comm:
            env["SHAPE_COMM"] = self.comm
        if self.lib:
            env["SHAPE_LIB"] = self.lib
        if self.children:
            if _is_python_helper(self):
                env["SHAPE_CHILDREN"] = json.dumps([{"argv": c.argv, "env": c.env()} for c in self.children])
            else:
                (child,) = self.children  # the C sleeper starts one child
                env["SHAPE_CHILD_ARGV"] = "\x1f".join(child.argv)
                env.update(child.env())
        return env

    def seen_argv(self) -> tuple[str, ...]:
        """argv as /proc shows it once the process runs (before any title)."""
        return (self.shebang, *self.argv) if self.shebang else tuple(self.argv)

    def walk(self) -> list[Node]:
        return [self, *(n for c in self.children for n in c.walk())]


def _is_python_helper(node: Node) -> bool:
    return bool(node.shebang) or os.path.basename(node.argv[0]).startswith("python")


def spawn_child(title: str, expect: str = "member", **kw: object) -> Node:
    """A child as multiprocessing's spawn starts it (vLLM EngineCore, workers, SGLang schedulers), then titled."""
    argv = [sys.executable, "-c", RUN_HELPER, "--multiprocessing-fork"]
    return Node(argv, expect, title=title, **kw)  # type: ignore[arg-type]
