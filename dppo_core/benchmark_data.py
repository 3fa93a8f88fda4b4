"""Benchmark datasets: GSM8K, MATH-500, AIME24, AMC23, Minerva Math, OlympiadBench (and MATH train).

Every set is loaded into one record type, :class:`BenchmarkRecord` (``problem``, ``answer``, ``id``,
``source``), from a local JSON-lines file (one object per line, the layout of ``shared/data/benchmarks``:
``gsm8k_test.jsonl``, ``math500_test.jsonl``, ...) or from the Hugging Face Hub through ``datasets``.

:func:`load_benchmark` resolves its argument in this order:

1. a path to an existing ``.jsonl`` file: that file;
2. a benchmark name (:data:`BENCHMARKS`) and ``data_dir=``: ``<data_dir>/<file>`` (it must be there);
3. a benchmark name and ``$DPPO_DATA_DIR`` set: ``$DPPO_DATA_DIR/<file>`` (it must be there);
4. a benchmark name otherwise: the Hugging Face Hub (needs ``pip install datasets`` and a network).

A configured local directory never falls back to the Hub, so an offline run fails with a message naming
the missing file instead of trying the network.

Normalisation: GSM8K's ``answer`` field is a worked solution ending in ``#### N``; the record's ``answer``
is ``N`` (thousands separators removed) and the worked solution is kept in ``solution``. For MATH
train, whose rows have only a solution, ``answer`` is the content of the solution's last ``\\boxed{}``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dppo_core.config import ConfigError

#: Appended to a problem that does not already ask for a boxed answer (GSM8K, Hub copies of the others).
BOX_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class DataError(ConfigError):
    """A task or benchmark that cannot be read as given: the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where one benchmark lives and which fields hold its problem and answer."""

    file: str  # file name in a local data directory
    hub_id: str  # Hugging Face dataset id
    hub_split: str
    hub_config: str | None = None
    problem_fields: tuple[str, ...] = ("problem", "question")  # first one present is used
    answer_fields: tuple[str, ...] = ("answer", "final_answer")
    # "final": the answer itself; "gsm8k": a solution ending in #### N; "boxed": a solution with \boxed{};
    # "auto" (files of unknown sets): "gsm8k" or "boxed" when the answer looks like one, else "final"
    answer_format: str = "final"


#: The benchmarks :func:`load_benchmark` knows by name. Test splits unless the name says otherwise.
BENCHMARKS: dict[str, BenchmarkSpec] = {
    "gsm8k": BenchmarkSpec("gsm8k_test.jsonl", "openai/gsm8k", "test", "main", answer_format="gsm8k"),
    "gsm8k_train": BenchmarkSpec("gsm8k_train.jsonl", "openai/gsm8k", "train", "main", answer_format="gsm8k"),
    "math500": BenchmarkSpec("math500_test.jsonl", "HuggingFaceH4/MATH-500", "test"),
    "aime24": BenchmarkSpec("aime24_test.jsonl", "HuggingFaceH4/aime_2024", "train"),
    "amc23": BenchmarkSpec("amc23_test.jsonl", "math-ai/amc23", "test"),
    "minerva_math": BenchmarkSpec("minerva_math_test.jsonl", "math-ai/minervamath", "test"),
    "olympiadbench": BenchmarkSpec("olympiadbench_test.jsonl", "math-ai/olympiadbench", "test"),
    "math": BenchmarkSpec("math_train.jsonl", "DigitalLearningGmbH/MATH-lighteval", "train",
                          answer_fields=("answer", "solution"), answer_format="boxed"),
}
#: The six evaluation sets of the usual math-reasoning suite.
EVAL_SUITE: tuple[str, ...] = ("gsm8k", "math500", "aime24", "amc23", "minerva_math", "olympiadbench")


@dataclass(frozen=True)
class BenchmarkRecord:
    """One benchmark problem, the same shape for every set."""

    problem: str  # the question as the set states it
    answer: str  # the reference final answer (LaTeX or a number), what rewards compare against
    id: str  # "<source>-<row index>"
    source: str  # the benchmark name, e.g. "gsm8k"
    solution: str | None = None  # a worked reference solution, where the set has one (GSM8K, MATH)

    @property
    def prompt(self) -> str:
        """The problem, with the instruction to box the answer appended when it does not ask already."""
        if "\\boxed" in self.problem:
            return self.problem
        return f"{self.problem.rstrip()}\n{BOX_INSTRUCTION}"

    def messages(self) -> list[dict[str, str]]:
        """The prompt as a one-message chat conversation."""
        return [{"role": "user", "content": self.prompt}]

    def to_record(self) -> dict:
        """A dataset row in TRL's conversational format (``prompt`` is a message list)."""
        return {"id": self.id, "prompt": self.messages(), "answer": self.answer, "source": self.source}


def _gsm8k_answer(solution: str, where: str) -> str:
    if "####" not in solution:
        raise DataError(f"{where}: a GSM8K answer must end in '#### <number>', got {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _boxed_answer(solution: str, where: str) -> str:
    from dppo_core.grading import find_boxed

    boxes = find_boxed(solution)
    if not boxes:
        raise DataError(f"{where}: the solution has no \\boxed{{}} answer: {solution[-80:]!r}")
    return boxes[-1][0].strip()


def _as_text(value: Any) -> str:
    """Answers arrive as strings, numbers (27.0) or lists of strings, depending on the copy."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ", ".join(_as_text(v) for v in value)
    return str(value).strip()


def make_record(row: dict, spec: BenchmarkSpec, source: str, index: int, where: str) -> BenchmarkRecord:
    """Normalise one raw row. ``where`` (file and line) goes into every error message."""
    problem_key = next((k for k in spec.problem_fields if k in row), None)
    answer_key = next((k for k in spec.answer_fields if k in row), None)
    for key, wanted in ((problem_key, spec.problem_fields), (answer_key, spec.answer_fields)):
        if key is None:
            raise DataError(
                f"{where}: missing field {' or '.join(map(repr, wanted))} (fields present: {sorted(row)}); "
                "each row needs a problem and an answer"
            )
    raw_answer = _as_text(row[answer_key])
    solution = None
    fmt = spec.answer_format
    if fmt == "auto":
        fmt = "gsm8k" if "\n####" in raw_answer else "boxed"
    if fmt == "gsm8k":
        solution, answer = raw_answer, _gsm8k_answer(raw_answer, where)
    elif fmt == "boxed" and "\\boxed" in raw_answer:
        solution, answer = raw_answer, _boxed_answer(raw_answer, where)
    else:
        answer = raw_answer
    return BenchmarkRecord(problem=str(row[problem_key]), answer=answer, id=f"{source}-{index}",
                           source=source, solution=solution)


def read_jsonl(path: str | Path, spec: BenchmarkSpec | None = None, source: str | None = None,
               limit: int | None = None) -> list[BenchmarkRecord]:
    """Records from a JSON-lines file. Blank lines are skipped; a bad line is an error naming its number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; pass the path of a .jsonl file (one problem/answer object per line), or "
            f"a benchmark name ({', '.join(BENCHMARKS)}) with data_dir= or $DPPO_DATA_DIR"
        )
    source = source or _name_for_file(path.name) or path.stem
    spec = spec or BENCHMARKS.get(source) or BenchmarkSpec(path.name, "", "", answer_format="auto")
    records: list[BenchmarkRecord] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}); save the file as "
                                 "UTF-8") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON "
                                "object") from e
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            records.append(make_record(row, spec, source, len(records), where))
            if limit is not None and len(records) >= limit:
                break
    return records


def _name_for_file(filename: str) -> str | None:
    return next((name for name, spec in BENCHMARKS.items() if spec.file == filename), None)


def _load_from_hub(name: str, spec: BenchmarkSpec, limit: int | None) -> list[BenchmarkRecord]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"loading {name!r} from the Hugging Face Hub needs the `datasets` package: "
            f"`pip install datasets`. Or pass a local copy: load_benchmark({name!r}, data_dir=DIR) with "
            f"DIR/{spec.file}, or set $DPPO_DATA_DIR"
        ) from e
    ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.hub_split)
    records = []
    for i, row in enumerate(ds):
        records.append(make_record(dict(row), spec, name, i, f"{spec.hub_id} row {i}"))
        if limit is not None and len(records) >= limit:
            break
    return records


def load_benchmark(name_or_path: str | Path, *, data_dir: str | Path | None = None,
                   limit: int | None = None, hub: bool = True) -> list[BenchmarkRecord]:
    """The records of a benchmark, by name (see :data:`BENCHMARKS`) or by the path of a ``.jsonl`` file.

    Args:
        name_or_path: ``"gsm8k"``, ``"math500"``, ``"aime24"``, ``"amc23"``, ``"minerva_math"``,
            ``"olympiadbench"``, ``"gsm8k_train"``, ``"math"``; or a file path.
        data_dir: a directory holding the files by their usual names (``gsm8k_test.jsonl``, ...).
            Default: ``$DPPO_DATA_DIR`` when set, else the Hugging Face Hub.
        limit: keep only the first ``limit`` records.
        hub: allow the Hugging Face Hub when no local directory is configured.

    The resolution order is in the module docstring.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    path = Path(name_or_path).expanduser()
    if path.suffix == ".jsonl" or path.is_file():
        return read_jsonl(path, limit=limit)
    if path.is_dir():
        raise DataError(
            f"{path} is a directory; pass a benchmark name with data_dir={str(path)!r}, "
            f"e.g. load_benchmark('gsm8k', data_dir={str(path)!r})"
        )
    name = str(name_or_path).lower().replace("-", "_")
    if name not in BENCHMARKS:
        raise DataError(
            f"unknown benchmark {str(name_or_path)!r}: known names are {', '.join(BENCHMARKS)}, "
            "or pass the path of a .jsonl file"
        )
    spec = BENCHMARKS[name]
    local = data_dir if data_dir is not None else os.environ.get("DPPO_DATA_DIR") or None
    if local is not None:
        file = Path(local).expanduser() / spec.file
        if not file.is_file():
            origin = "data_dir" if data_dir is not None else "$DPPO_DATA_DIR"
            raise FileNotFoundError(
                f"benchmark {name!r}: {file} does not exist ({origin}={local}); put {spec.file} there, "
                f"point {origin} at the directory that has it, or unset it to load from the Hub"
            )
        return read_jsonl(file, spec, name, limit)
    if not hub:
        raise FileNotFoundError(
            f"benchmark {name!r}: no local directory configured and hub=False; pass data_dir= or set "
            "$DPPO_DATA_DIR"
        )
    return _load_from_hub(name, spec, limit)
