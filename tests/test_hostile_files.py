"""Hostile input, round two (issue [robustness]), in the files a spec is or names: a spec file that is not
UTF-8 or is gigabytes long, a task data file that is gigabytes long or holds a row or cell too big or too
deeply nested, an image that is a decompression bomb, and a PASTA head map whose layer is not a number.
Each is run through the command line as a user types it: one ``error:`` line naming the file and the place
(line, byte, row, key), the limit and the fix, exit code 2, no traceback, and, where the file alone tells,
no run store created."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fixtures.cli import cli, error_line

TASK = "{kind: repeated_tokens, n: 2, length: 4}"


def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    """A file of ``size`` bytes that takes no disk: ``head``, then a hole."""
    with path.open("wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


# --------------------------------------------------------------------------- the spec file
def test_a_spec_file_that_is_not_utf8_names_the_file_line_byte_and_the_fix(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = f'name: t\nmodel: headlab-tiny\ntask: {TASK}\nsteps:\n  - id: ind\n    detect: {{kind: induction}}\n'
    text += 'note: "café"\n'
    Path("latin.yaml").write_bytes(text.encode("latin-1"))
    offset = text.encode("latin-1").index(b"\xe9")
    for command in (["validate", "latin.yaml"], ["run", "latin.yaml", "--out", "runs"]):
        code, err = cli(command, capfd)
        line = error_line(err)
        assert code == 2, err
        assert line.startswith("error: latin.yaml:7:11: the file is not UTF-8"), line
        assert f"byte 0xe9 at byte offset {offset} (line 7, column 11)" in line and "save it as UTF-8" in line, line
    assert not Path("runs").exists()


def test_a_huge_spec_file_is_refused_by_its_size_before_it_is_read(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    size = 3 * 2**30  # 3 GiB, sparse: reading it whole was a MemoryError (exit 1)
    sparse(Path("big.yaml"), size, b"name: t\n")
    start = time.perf_counter()
    code, err = cli(["run", "big.yaml", "--out", "runs"], capfd)
    assert time.perf_counter() - start < 5
    line = error_line(err)
    assert code == 2, err
    assert line.startswith(f"error: big.yaml: the spec file is {size:,} bytes; the limit is 262,144 bytes "
                           "(MAX_SPEC_BYTES"), line
    assert not Path("runs").exists()
    assert cli(["validate", "big.yaml"], capfd)[0] == 2


# --------------------------------------------------------------------------- a PASTA head map
def pasta_spec(heads: str) -> str:
    return (f"name: t\nmodel: headlab-tiny\ntask: {{kind: emphasis, n: 2}}\nsteps:\n  - id: gen\n    generate:\n"
            f"      max_new_tokens: 1\n      steer: [{{kind: pasta, heads: {heads}}}]\n")


@pytest.mark.parametrize("heads, key, col", [('{"abc": [0]}', "abc", 37), ('{"1": [0], "x": [1]}', "x", 47),
                                             ('{"-1": [0]}', "-1", 37)])
def test_a_pasta_head_map_whose_layer_is_not_a_number_is_refused_when_validated(tmp_path, capfd, monkeypatch, heads,
                                                                                 key, col):
    monkeypatch.chdir(tmp_path)
    Path("p.yaml").write_text(pasta_spec(heads))
    for command in (["validate", "p.yaml"], ["run", "p.yaml", "--out", "runs"]):
        code, err = cli(command, capfd)
        line = error_line(err)
        assert code == 2, err
        assert line.startswith(f"error: p.yaml:8:{col}: steps[0].generate.steer[0].heads.{key}: layer key '{key}' "
                               "is not a layer number"), line
        assert 'a head map is {"<layer>": [heads]} with each layer written as a number 0 .. 2,147,483,647' in line
    assert not Path("runs").exists()  # refused before the store (it was a bare ValueError mid-run)
    Path("p.yaml").write_text(pasta_spec('{"1": [0], 2: [1]}'))  # digits, or a YAML integer key
    assert cli(["validate", "p.yaml"], capfd)[0] == 0
