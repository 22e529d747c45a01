"""The demo task: reverse a short string. Its prompts, its verifier reward and its data generator.

A prompt record is {"prompt": "abcd=", "answer": "dcba"}; the policy should answer "dcba".
`python -m moeloop.steps.demo_task --out configs/data` regenerates the shipped prompt files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from moeloop.steps.errors import ArgumentParser, run_cli

ALPHABET = "abcdefgh"
SEPARATOR = "="


def reverse_positions(record: dict, response: str) -> float:
    """Dense verifier reward in [0, 1]: the fraction of answer positions the response gets right.

    Extra characters count against the response, so padding it out never helps.
    """
    answer = record["answer"]
    correct = sum(1 for got, want in zip(response, answer, strict=False) if got == want)
    return correct / max(len(answer), len(response))


def make_prompts(count: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    records, seen = [], set(exclude)
    while len(records) < count:
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(4, 6)))
        if text in seen:
            continue
        seen.add(text)
        records.append({"prompt": text + SEPARATOR, "answer": text[::-1]})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=20000)
    parser.add_argument("--eval", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    evaluation = make_prompts(args.eval, rng, exclude=set())
    training = make_prompts(args.train, rng, exclude={r["answer"][::-1] for r in evaluation})
    write_jsonl(args.out / "reverse-train.jsonl", training)
    write_jsonl(args.out / "reverse-eval.jsonl", evaluation)


if __name__ == "__main__":
    run_cli(main)
