"""Helpers shared by the benchmark scripts: the random Llama they measure, running one measurement in a
fresh subprocess (so its peak memory is its own), measuring its peak memory growth, and printing results and
ratios."""

from __future__ import annotations

import argparse
import json
import os
import subprocess


def random_llama(impl: str, device: str, dtype: str, *, layers: int, heads: int, head_dim: int, vocab: int,
                 **config):
    """A seeded random-weight Llama (MHA) with the given attention implementation ("headlab" registered)."""
    import torch
    import transformers

    from headlab import instrument as ins

    ins.register()
    cfg = transformers.LlamaConfig(
        hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=65536,
        **config)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl, dtype=getattr(torch, dtype))
    return m.eval().to(device)


def add_case_options(p: argparse.ArgumentParser) -> None:
    """The options of a script that measures each case in a subprocess of itself: ``--timeout`` (seconds per
    case), ``--threads`` and the hidden ``--_case`` (set in the subprocess: measure that case and print JSON)."""
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = torch default); 1 avoids OpenMP stalls on a shared machine")
    p.add_argument("--_case", default=None, help=argparse.SUPPRESS)


def mem_available() -> int:
    """The memory available to new processes (``MemAvailable`` of /proc/meminfo), in bytes; 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_base(device: str) -> int:
    """The baseline of :func:`peak_growth`, in bytes: on CUDA the allocated memory (after resetting the peak
    statistics), on CPU the resident set size."""
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(device: str, base: int) -> int:
    """Bytes the peak memory rose above ``base`` (:func:`memory_base`): ``torch.cuda.max_memory_allocated`` on
    CUDA, the peak resident set size (``ru_maxrss``) on CPU; 0 when it did not rise."""
    if device == "cuda":
        import torch

        peak = torch.cuda.max_memory_allocated() - base
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return max(0, peak)


def run_case(cmd: list[str], timeout: float, killed: str = "killed") -> dict:
    """Run one measurement subprocess; its last stdout line is a JSON dict, or an ``error`` entry."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s"}
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [killed]
        return {"error": f"rc={r.returncode}: {tail[0][:120]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def fmt(r: dict, seconds: str = "{:.3f}s") -> str:
    """A measurement as ``time, peak growth`` (or why it is missing)."""
    if "error" in r:
        return f"FAILED/SKIPPED ({r['error']})"
    return f"{seconds.format(r['seconds'])}, peak +{r['peak_bytes'] / 2**20:.0f} MiB"


def ratio(a: dict, b: dict, key: str) -> str:
    """``a[key] / b[key]`` as ``1.23x``, or ``n/a``."""
    if "error" in a or "error" in b or not b[key]:
        return "n/a"
    return f"{a[key] / b[key]:.2f}x"


def _pop_write(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--write [PATH]`` / ``--write=PATH``, and PATH ("" for the default; None: absent)."""
    rest, path = [], None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--write":
            path = ""
            if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                path = argv[i + 1]
                i += 1
        elif a.startswith("--write="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return rest, path


def _machine() -> str:
    """The machine a benchmark ran on, in one line: CPU model and cores, GPU, and the versions that matter."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [f"{cpu}, {os.cpu_count()} cores"]
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
        if gpus.returncode == 0 and gpus.stdout.strip():
            parts.append(", ".join(gpus.stdout.split("\n")[:8]).strip(", "))
    except (OSError, subprocess.TimeoutExpired):
        pass
    versions = []
    for pkg in ("headlab", "torch", "transformers"):
        try:
            versions.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    return "; ".join(parts + [f"Python {platform.python_version()}", ", ".join(versions)])


def _commit(root: str) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (sha or "unknown") + (" with uncommitted changes" if dirty else "")


SECTION_START = "<!-- written by --write: "
SECTION_END = "<!-- end of --write output -->"


def merge_section(old: str | None, title: str, command: str, section: str) -> str:
    """The results file after a ``--write`` run of ``command``: its ``title`` line, then one section per distinct
    command, each between markers. The run's ``section`` replaces the section of the same command, or follows the
    last written section; text outside the markers (a note, an older recorded run) stays. A file with no marked
    section (written by hand) is replaced whole."""
    block = f"{SECTION_START}{command} -->\n{section.strip()}\n{SECTION_END}\n"
    if not old or SECTION_START not in old:
        return f"{title}\n\n{block}"
    lines = old.splitlines(keepends=True)
    if lines and lines[0].startswith("# "):
        lines[0] = title + "\n"
    text = "".join(lines)
    start = text.find(f"{SECTION_START}{command} -->\n")
    if start >= 0:
        end = text.index(SECTION_END, start) + len(SECTION_END) + 1
        return text[:start] + block + text[end:]
    end = text.rindex(SECTION_END) + len(SECTION_END) + 1
    return text[:end] + "\n" + block + text[end:]


def shown_argument(arg: str, root: str) -> str:
    """A command-line argument as a results file shows it: an absolute path inside ``root`` relative to it, one
    outside as ``<elsewhere>/`` and its last three parts (a peer's interpreter in a virtual environment of its own
    reads ``<elsewhere>/.venv-tl/bin/python``: no developer's machine is named); anything else as it is."""
    if not os.path.isabs(arg):
        return arg
    rel = os.path.relpath(arg, root)
    if not rel.startswith(".."):
        return rel
    return "<elsewhere>/" + "/".join(arg.rstrip("/").split("/")[-3:])


def main_writing_results(main, script: str) -> None:
    """Run a benchmark's ``main``; with ``--write [PATH]`` also write what it prints (its own and its
    subprocesses' standard output) to ``benchmarks/results/<script name>.md`` (or PATH) once it succeeds, as a
    section headed by the command, with the date, the machine and the commit. A later run with another command
    adds its own section to the file; one with the same command replaces that section (:func:`merge_section`). The
    command shows paths as :func:`shown_argument` does.
    The docs site's Results section is built from those files."""
    import datetime as dt
    import shlex
    import sys

    argv, path = _pop_write(sys.argv[1:])
    if path is None or "--_case" in argv:
        main()
        return
    here = os.path.dirname(os.path.abspath(script))
    name = os.path.splitext(os.path.basename(script))[0]
    path = path or os.path.join(here, "results", f"{name}.md")
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()[0]
    proc = subprocess.Popen([sys.executable, script, *argv], stdout=subprocess.PIPE, text=True, bufsize=1)
    printed = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        printed.append(line)
    if proc.wait() != 0:
        sys.exit(proc.returncode)
    first = (sys.modules["__main__"].__doc__ or name).strip().split("\n\n")[0]
    doc = " ".join(first.split()).split(". ")[0].rstrip(".")  # the docstring's first sentence
    seconds = (dt.datetime.now(dt.timezone.utc) - started).total_seconds()
    shown = [shown_argument(a, os.path.dirname(here)) for a in argv]
    command = " ".join([f"python benchmarks/{name}.py"] + [a if a.startswith("<elsewhere>/") else shlex.quote(a)
                                                             for a in shown])
    section = "\n".join([
        f"## `{command}`", "",
        f"Written by `--write` on {started:%Y-%m-%d %H:%M} UTC ({seconds:.0f} s), commit {_commit(here)}.",
        f"Machine: {_machine()}; 1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the"
        " end (other processes' share of the cores: timings on a loaded machine move with it).", "",
        "```text", "".join(printed).rstrip("\n"), "```",
    ])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    old = open(path).read() if os.path.exists(path) else None
    with open(path, "w") as f:
        f.write(merge_section(old, f"# {name}: {doc}", command, section))
    print(f"wrote {path}", file=sys.stderr)
