"""Move constraints.txt forward: only to versions the test suite passes on.

    python tools/refresh_constraints.py                 # resolve, install, test, rewrite if green
    python tools/refresh_constraints.py --dry-run       # resolve and print what would move, no test

1. Resolves the newest versions inside pyproject.toml's ranges (``uv pip compile --upgrade``) for every
   package the README's two commands install (headlab with its dev, notebook, eval, ray, triton and docs
   extras), on this interpreter (Python 3.11, Linux), with torch held at the version of constraints.txt
   (the CPU build lies on disk; move it by hand with ``--torch``).
2. Installs them into a scratch environment (``--env``, default ``.venv-refresh``) with uv, as
   .ci/setup-test does, and runs ``pip check``, ruff and the default test suite there, from the
   repository root.
3. Only if all pass, rewrites constraints.txt and prints what moved (``name old -> new``, added,
   removed). A failing suite leaves constraints.txt as it was and exits 1, naming what failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
EXTRAS = ("dev", "notebook", "eval", "ray", "triton", "docs")
HEADER = """\
# The exact versions headlab's test suite last passed on: Python 3.11, Linux x86_64, the CPU build of
# torch. .ci/setup-quickstart and .ci/setup-test install from this file (with uv); pyproject.toml keeps
# ranges. Do not edit by hand: tools/refresh_constraints.py resolves the newest versions inside those
# ranges, runs the suite on them and rewrites this file only if it passes.
"""


def uv_version() -> str:
    """The uv version the set-up scripts pin (.ci/uv.sh)."""
    text = (ROOT / ".ci" / "uv.sh").read_text()
    return re.search(r"^UV_VERSION=([0-9.]+)", text, flags=re.M).group(1)


def read_pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a constraints file (names normalised as PEP 503 does)."""
    pins = {}
    if not path.is_file():
        return pins
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def find_links() -> list[str]:
    """pip's find-links (a folder of local wheels, such as torch's CPU build) as uv arguments."""
    links = os.environ.get("UV_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS") or ""
    if not links:
        res = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                             capture_output=True, text=True)
        links = res.stdout.strip() if res.returncode == 0 else ""
    return [arg for link in links.split() for arg in ("--find-links", link)]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", shlex.join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, **kw)


def make_env(env: Path, python: str) -> Path:
    """A fresh virtual environment with uv in it; returns its python."""
    if env.exists():
        shutil.rmtree(env)
    run([python, "-m", "venv", str(env)], check=True)
    py = env / "bin" / "python"
    run([str(py), "-m", "pip", "install", "-q", f"uv=={uv_version()}"], check=True)
    return py


def resolve(py: Path, torch: str, out: Path) -> dict[str, str]:
    """The newest versions inside pyproject.toml's ranges, torch held at ``torch``."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as hold:
        hold.write(f"torch=={torch}\n")
    cmd = [str(py), "-m", "uv", "pip", "compile", str(ROOT / "pyproject.toml"), "--upgrade", "--quiet",
           "--python", str(py), *(a for e in EXTRAS for a in ("--extra", e)), "--constraints", hold.name,
           "--no-header", "--no-annotate", *find_links(), "-o", str(out)]
    run(cmd, check=True, cwd=ROOT)
    os.unlink(hold.name)
    pins = read_pins(out)
    pins["torch"] = torch  # the local build label (+cpu) is dropped: ==2.13.0 matches it and PyPI's
    pins["uv"] = uv_version()
    pins.pop("headlab", None)
    return pins


def write(path: Path, pins: dict[str, str], note: str) -> None:
    body = "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))
    path.write_text(HEADER + f"# {note}\n" + body)


def moved(old: dict[str, str], new: dict[str, str]) -> list[str]:
    lines = [f"  {n} {old[n]} -> {new[n]}" for n in sorted(old.keys() & new.keys()) if old[n] != new[n]]
    lines += [f"  + {n} {new[n]}" for n in sorted(new.keys() - old.keys())]
    lines += [f"  - {n} {old[n]}" for n in sorted(old.keys() - new.keys())]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", type=Path, default=ROOT / ".venv-refresh", help="scratch environment (remade)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the scratch environment")
    ap.add_argument("--torch", default=None, help="torch version to hold (default: constraints.txt's)")
    ap.add_argument("--dry-run", action="store_true", help="resolve and print what would move; no test")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments (quoted)")
    args = ap.parse_args(argv)

    old = read_pins(CONSTRAINTS)
    torch = args.torch or old.get("torch")
    if not torch:
        ap.error("constraints.txt names no torch version: pass --torch")
    py = make_env(args.env, args.python)
    candidate = args.env / "constraints.candidate.txt"
    new = resolve(py, torch, candidate)
    write(candidate, new, "candidate, not yet tested")
    changes = moved(old, new)
    print(f"{len(changes)} change(s) against constraints.txt:", *changes, sep="\n")
    if args.dry_run:
        return 0

    env = {**os.environ, "VIRTUAL_ENV": str(args.env), "PATH": f"{args.env / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    install = [str(py), "-m", "uv", "pip", "install", "--quiet", "--python", str(py), "--constraints",
               str(candidate), "--build-constraints", str(candidate), *find_links(), "-e",
               f".[{','.join(EXTRAS)}]"]
    compile_ = [str(py), "-m", "compileall", "-q", "-j", "0", str(args.env / "lib"), "headlab"]
    steps = [("install", install), ("pip check", [str(py), "-m", "pip", "check"]), ("byte-compile", compile_),
             ("ruff", [str(py), "-m", "ruff", "check", "."]),
             ("tests", [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--dist", "loadfile",
                        *shlex.split(args.pytest_args)])]
    started = dt.datetime.now()
    tail = ""
    for name, cmd in steps:
        res = run(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if name == "byte-compile":
            continue  # torch ships a Python 3.12-only test file; a file the suite needs and cannot compile fails it
        print(res.stdout[-4000:] if name in ("tests", "pip check") or res.returncode else "", end="")
        if res.returncode != 0:
            print(f"refresh-constraints: {name} failed on the candidate versions (exit {res.returncode}); "
                  f"constraints.txt is unchanged (candidate: {candidate})", file=sys.stderr)
            return 1
        if name == "tests":
            tail = next((ln.strip("= ") for ln in reversed(res.stdout.splitlines()) if " passed" in ln), "")
    minutes = (dt.datetime.now() - started).total_seconds() / 60
    write(CONSTRAINTS, new, f"Written by tools/refresh_constraints.py on {dt.date.today().isoformat()}: "
                            f"{tail} ({minutes:.0f} min with the install).")
    print(f"constraints.txt rewritten: {len(changes)} change(s)", *changes, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
