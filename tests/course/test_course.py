"""``dppo_core.tools.course.check``: an exercise's feedback is the solution's asserts, run on the student's code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dppo_core.tools.course as course_module
from dppo_core.tools.course import CPU_KERNEL_PINS, RESULTS, chapter_results, check, load_solutions, pin_cpu_kernels


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2] / "notebooks")   # where a chapter runs


def test_the_solution_itself_passes(capsys):
    solutions = load_solutions("ch03_grpo")
    verdict = check("ch03_grpo", 1, my_k3=solutions.my_k3)
    assert verdict and verdict == True and verdict.passed  # noqa: E712
    assert "✓ exercise 1: every check of solutions/ch03_grpo.py passed" in capsys.readouterr().out


def test_a_stub_is_not_done_yet(capsys):
    def my_k3(logp, ref_logp):
        raise NotImplementedError

    assert not check("ch03_grpo", 1, my_k3=my_k3)
    assert "… exercise 1: not done yet (`my_k3` raises NotImplementedError)" in capsys.readouterr().out


def test_a_wrong_answer_shows_the_failed_assert(capsys):
    def my_k3(logp, ref_logp):                     # forgot the "- d" term
        return (ref_logp - logp).exp() - 1

    assert not check("ch03_grpo", 1, my_k3=my_k3)
    out = capsys.readouterr().out
    assert "✗ exercise 1: a check failed (line" in out and "assert torch.allclose(my_k3(logp, ref)" in out


def test_an_error_in_the_students_code_is_reported_not_raised(capsys):
    def my_advantages(rewards, scale):
        return rewards.mean(dim=2)                 # no dimension 2

    assert not check("ch03_grpo", 2, my_advantages=my_advantages)
    out = capsys.readouterr().out
    assert "✗ exercise 2: the code raised IndexError at line" in out and "my_advantages()" in out


def test_a_piece_left_out_is_an_error_not_a_pass():
    """Left out, the solution's own piece (the parameter's default) would be checked and pass."""
    with pytest.raises(TypeError, match=r"pass your my_k3 too \(my_k3=my_k3\)"):
        check("ch03_grpo", 1)


def test_not_implemented_in_library_code_is_an_error_not_a_stub(capsys):
    def my_k3(logp, ref_logp):                     # calls something that raises NotImplementedError itself
        return torch.distributions.Distribution(validate_args=False).mean

    assert not check("ch03_grpo", 1, my_k3=my_k3)
    out = capsys.readouterr().out
    assert "not done yet" not in out and "✗ exercise 1: the code raised NotImplementedError at line" in out
    assert "my_k3()" in out                        # the student's line, not the library's


def test_an_assert_in_the_students_own_code_is_their_error(capsys):
    def my_k3(logp, ref_logp):
        assert logp.dim() == 1, "my_k3 expects one row"
        return logp

    assert not check("ch03_grpo", 1, my_k3=my_k3)
    out = capsys.readouterr().out
    assert "✗ exercise 1: the code raised AssertionError at line" in out and "my_k3 expects one row" in out


def test_a_class_piece_that_is_still_a_stub_is_not_done_yet(capsys):
    class Half:
        def __call__(self, logp, ref_logp):
            raise NotImplementedError

    assert not check("ch03_grpo", 1, my_k3=Half())
    assert "not done yet (`my_k3` raises NotImplementedError)" in capsys.readouterr().out


def test_the_checks_run_under_python_dash_o():
    """The asserts are the checks: compiled with optimize=0 they run even when Python strips asserts."""
    code = ("from dppo_core.tools.course import check; import sys; "
            "sys.exit(0 if not check('ch03_grpo', 1, my_k3=lambda logp, ref: logp * 0) else 1)")
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2] / "notebooks")
    assert done.returncode == 0 and "✗ exercise 1: a check failed" in done.stdout, done.stdout + done.stderr


def test_a_wrong_piece_name_or_file_is_a_clear_error():
    with pytest.raises(TypeError, match="exercise 1 takes my_k3, not k3"):
        check("ch03_grpo", 1, k3=lambda a, b: a)
    with pytest.raises(ValueError, match="has no exercise_9; it has exercise_1, exercise_2, exercise_3"):
        check("ch03_grpo", 9)
    with pytest.raises(ValueError, match="names a solutions file, like 'ch03_grpo'"):
        check("03_grpo.ipynb", 1)


def _no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    import socket
    import urllib.request

    def refused(*args, **kwargs):
        raise AssertionError("tried the network")

    monkeypatch.setattr(urllib.request, "urlopen", refused)
    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(socket.socket, "connect", refused)


def test_outside_a_checkout_the_solutions_come_from_the_package(tmp_path, monkeypatch, capsys):
    """Opened alone (Colab, a workshop laptop), offline: the file is the one the package ships."""
    import dppo_core.tools.course as course

    _no_network(monkeypatch)
    monkeypatch.setattr(course, "_LOADED", {})
    monkeypatch.delitem(sys.modules, "ch03_grpo", raising=False)        # restored after the test
    monkeypatch.chdir(tmp_path)
    assert not check("ch03_grpo", 2, my_advantages=lambda r, s: torch.zeros_like(r))
    shipped = Path(course.__file__).resolve().parents[1] / "assets" / "course" / "solutions" / "ch03_grpo.py"
    assert course.SOLUTIONS == shipped.parent and load_solutions("ch03_grpo").__file__ == str(shipped)
    out = capsys.readouterr().out                  # the failed assert is quoted from the package's file
    assert "a check failed (line" in out and "assert torch.allclose(my_advantages(one_right" in out
    with pytest.raises(FileNotFoundError, match=r"no solutions file ch99_nothing\.py \(it has ch00_tiny_model"):
        load_solutions("ch99_nothing")


REPOSITORY = Path(__file__).resolve().parents[2]
SYNC = "python -m dppo_core.tools.course --sync-results"


def test_the_chapters_committed_results_are_found_with_their_loops_expanded():
    """Every ``committed_result("...")`` of the chapters' code cells, the seed loop of chapter 03 expanded: if a
    chapter reads a file this list misses, the snapshot test below cannot see it."""
    paths = chapter_results(REPOSITORY / "notebooks")
    curves = [f"benchmarks/results/tiny-grpo/curves-kl-0.04/seed-{s}/{f}.jsonl" for s in (0, 1, 2)
              for f in ("eval", "metrics")]
    assert set(paths) >= {*curves, "benchmarks/results/packing/update_time.json",
                          "benchmarks/results/cpu-baselines/bench.json", "benchmarks/results/cpu-peers/bench.json"}


def test_chapter_results_reads_literals_loops_and_f_strings_and_refuses_the_rest(tmp_path):
    def chapter(*cells):
        cells = [{"cell_type": "code", "source": s, "metadata": {}, "outputs": []} for s in cells]
        (tmp_path / "00_x.ipynb").write_text(json.dumps({"cells": cells}))

    chapter('%matplotlib inline\nx = committed_result("a/b.json")',
            'for k in ("p", "q"):\n    d = f"r/{k}"\n    y = read(committed_result(f"{d}/m.jsonl"))\n'
            'for k, v in pairs.items():\n    print(k)',
            'import dppo_core.tools.bench as bench\nz = bench.committed_result("c.md")')
    assert chapter_results(tmp_path) == ["a/b.json", "c.md", "r/p/m.jsonl", "r/q/m.jsonl"]
    chapter('name = pick()\ncommitted_result(f"r/{name}.json")')
    with pytest.raises(ValueError, match=r"00_x\.ipynb, cell 0: cannot tell which file committed_result"):
        chapter_results(tmp_path)


def test_the_packaged_results_snapshot_is_the_repositorys_files():
    """The committed results the chapters read ship in the package (dppo_core/assets/course/results/<path>), so
    an installed package needs no network: each copy equals the repository's file byte for byte, and the
    snapshot holds nothing else."""
    paths = chapter_results(REPOSITORY / "notebooks")
    fix = f"run `{SYNC}` and commit dppo_core/assets/course/results/"
    missing = [p for p in paths if not (RESULTS / p).is_file()]
    assert not missing, f"the chapters read these, which dppo_core does not ship: {missing}; {fix}"
    stale = [p for p in paths if (RESULTS / p).read_bytes() != (REPOSITORY / p).read_bytes()]
    assert not stale, f"the package's copies differ from the committed files: {stale}; {fix}"
    extra = sorted(q.relative_to(RESULTS).as_posix() for q in RESULTS.rglob("*") if q.is_file())
    extra = [q for q in extra if q not in paths]
    assert not extra, f"the snapshot holds files no chapter reads: {extra}; {fix}"
    listed = (RESULTS.parent / course_module.RESULTS_LIST).read_text(encoding="utf-8").splitlines()
    assert listed == paths, f"dppo_core/assets/course/{course_module.RESULTS_LIST} lists other files; {fix}"
    assert RESULTS == Path(course_module.__file__).resolve().parents[1] / "assets" / "course" / "results"


def test_no_chapter_downloads_from_the_repository():
    found = [f"{nb.name}, cell {k}" for nb in sorted((REPOSITORY / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
             for k, c in enumerate(json.loads(nb.read_text())["cells"])
             if c["cell_type"] == "code" and re.search(r"raw\.githubusercontent|github\.com|urlopen|requests\.get",
                                                       "".join(c["source"]))]
    assert not found, f"a chapter reads from the network once the package is installed: {found}"


def test_sync_results_copies_what_the_chapters_read_and_drops_the_rest(tmp_path, monkeypatch, capsys):
    import dppo_core.tools.course as course

    checkout = tmp_path / "clone"
    (checkout / "notebooks").mkdir(parents=True)
    (checkout / "benchmarks" / "results" / "x").mkdir(parents=True)
    (checkout / "benchmarks" / "results" / "x" / "a.json").write_text('{"a": 1}')
    cell = {"cell_type": "code", "source": 'committed_result("benchmarks/results/x/a.json")', "metadata": {},
            "outputs": []}
    (checkout / "notebooks" / "07_x.ipynb").write_text(json.dumps({"cells": [cell]}))
    snapshot = tmp_path / "results"
    (snapshot / "benchmarks" / "old").mkdir(parents=True)
    (snapshot / "benchmarks" / "old" / "gone.json").write_text("{}")
    monkeypatch.setattr(course, "RESULTS", snapshot)
    assert course.main(["--sync-results", "--root", str(checkout)]) == 0
    assert "copied 1 committed results" in capsys.readouterr().out
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")) == [
        "benchmarks", "benchmarks/results", "benchmarks/results/x", "benchmarks/results/x/a.json"]
    assert (snapshot / "benchmarks/results/x/a.json").read_text() == '{"a": 1}'
    assert (tmp_path / "results.txt").read_text() == "benchmarks/results/x/a.json\n"  # beside the snapshot
    with pytest.raises(FileNotFoundError, match="not a checkout of the repository"):
        course.sync_results(tmp_path / "nowhere")


def test_the_kernel_pins_are_the_makefiles():
    import re
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert dict(re.findall(r"^export (ATEN_CPU_CAPABILITY|MKL_CBWR|ONEDNN_MAX_CPU_ISA) \?= (\S+)$", makefile,
                           re.M)) == CPU_KERNEL_PINS


def test_pin_cpu_kernels_sets_them_before_torch_loads(tmp_path):
    """In a fresh interpreter without the variables (plain `jupyter lab`): pinned, and torch runs at AVX2."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    no_avx2 = tmp_path / "cpuinfo-arm"
    no_avx2.write_text("Features\t: fp asimd\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    code = (f"from dppo_core.tools.course import pin_cpu_kernels; print(pin_cpu_kernels({str(no_avx2)!r})); "
            f"print(pin_cpu_kernels({str(cpuinfo)!r})); import torch; "
            "print(torch.backends.cpu.get_cpu_capability())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "{}"                                              # not an AVX2 CPU: nothing set
    assert lines[1] == str({"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    here = Path("/proc/cpuinfo")
    if here.is_file() and re.search(r"\bavx512f\b", here.read_text()):
        # this CPU would run AVX-512 kernels unpinned: the pin is what makes torch run its AVX2 ones
        probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
        unpinned = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                  check=True).stdout.strip()
        assert unpinned != "AVX2" and lines[2] == "AVX2", (unpinned, lines[2])


def test_pin_cpu_kernels_says_when_torch_came_first(tmp_path, monkeypatch, capsys):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: avx2\n")
    monkeypatch.setattr(os, "environ", {})         # nothing set yet, and torch is imported (by this test file)
    assert pin_cpu_kernels(cpuinfo) == CPU_KERNEL_PINS
    assert "torch was imported before the kernel pins were set" in capsys.readouterr().out
    pin_cpu_kernels(cpuinfo)                       # already set: nothing to say
    assert capsys.readouterr().out == ""

