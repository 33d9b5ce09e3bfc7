"""Draw countdown problem sets into the experiment's cache format, ahead of a device run.

The 4-number ("hard") set takes about 8 CPU minutes to draw: drawing it here keeps that off
the GPU machine's clock. tools/countdown_gpu.sh copies the files from .gpu/problems into its
state folder.

    python tools/draw_countdown_problems.py --difficulties demo,hard --out .gpu/problems
    python tools/draw_countdown_problems.py --difficulties hard --answers trace --train-problems 2000  # trace cells
"""
import argparse
import pathlib
import types

from zerokl import experiment


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--difficulties", default="demo,hard", help="comma-separated (zerokl.tasks.setup.DIFFICULTIES)")
    ap.add_argument("--out", default=".gpu/problems", help="folder for problems-<difficulty>-seed<S>-<N>.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-problems", type=int, default=None, help="default: the experiment's (2000 easy, else 20000)")
    ap.add_argument("--answers", default="short", help="short, or trace: the problems of the trace cells (the map's: "
                    "--difficulties hard --train-problems 2000)")
    ap.add_argument("--eval-prompts", type=int, default=128, help="test problems (the run's --eval-prompts)")
    args = ap.parse_args()
    for difficulty in args.difficulties.split(","):
        n = args.train_problems or (2000 if difficulty == "easy" else 20000)
        setting = types.SimpleNamespace(difficulty=difficulty, seed=args.seed, train_problems=n, answers=args.answers,
                                        eval_prompts=args.eval_prompts)
        experiment._data(setting, pathlib.Path(args.out))     # draws and caches, or finds the cache
        print(f"{difficulty}: {n} train problems in {args.out}", flush=True)


if __name__ == "__main__":
    main()
