"""Variance of the gradient estimate per unit of cost, for each pruning scheme, on the tiny model's real gradients.

Made with (from the repository root; about 10 minutes on 2 CPU cores):

    DPPO_CACHE_DIR=.cache/dppo ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/variance_cost.py --output benchmarks/results/variance_cost.json

(``variance_cost.md`` goes next to the JSON; both record the command.)

What a step estimates is μ, the policy gradient averaged over the prompt pool (prompts are drawn i.i.d. from
it). Two sources of noise: which prompts (and rollouts) the step drew, and which of them pruning kept. Per
scheme this measures both on the whole gradient vector, and what the step costs:

* Schemes (:data:`SCHEMES`): overrides of the preset's ``dppo_paper`` configuration, the default ``dppo`` among them.
* Setup: the cpu-baselines preset's grpo configuration (the warm-started tiny model, β = 0), ``--warm-steps``
  full-batch GRPO steps, then per batch ``--candidates`` prompts rolled out ``--history-rollouts`` times for
  the prompt history (what prompt pruning reads) and once more: the candidates every draw selects from. Each
  completion's gradient g̃_qi (its loss term with normaliser G, so one prompt's S̃_q = Σ_i g̃_qi is on the scale
  of μ) is computed once, with the trainer's loss (benchmarks/update_bias.py's ``per_completion_grads``).
* Data noise: prompts are i.i.d., so a step over a window of W prompts has tr Cov = σ² / W with σ² the sample
  variance of the S̃_q (trace of the covariance) over the candidates.
* Pruning noise: ``--draws`` draws through the scheme's estimator (``select`` on the candidates with size
  ``prompts_per_step``, then ``weigh``: the package's own code), each a weight vector u over the window's
  completions; tr Cov of the pruned estimate around the window's full gradient is E[(u - 1)ᵀ K (u - 1)] / W²
  with K the Gram matrix of the g̃. Total variance V = σ² / W + that.
* Cost: expected seconds per step from a linear model, a × prompts rolled out + b × completion tokens trained,
  with a and b the seconds per rolled-out prompt and per trained token of ``grpo_skip`` in ``--timing`` (a
  committed bench.json of the same setting).
* Figure of merit: V × cost, the variance of an estimate that one second of steps buys (averaging n steps
  divides V by n); reported relative to ``grpo_skip`` (< 1 is better). Also ‖μ̂‖²-relative noise V / ‖ḡ‖².
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_bias import gram, per_completion_grads, trainer_params  # noqa: E402

from dppo_core.data import prompt_key  # noqa: E402
from dppo_core.grpo import group_advantages  # noqa: E402
from dppo_core.tools.bench.presets import bench_preset, method_config  # noqa: E402
from dppo_core.trainer import DPPOTrainer  # noqa: E402

#: The schemes compared: overrides of the dppo_paper method (the paper's rule made unbiased: prompt scheme paper
#: at rate 0.8, completions proportional to |A| at 0.5, floors 0.2, systematic sampling; grpo_skip: nothing
#: pruned but A = 0).
SCHEMES: dict[str, dict] = {
    "grpo_skip": {"prompt_prune_rate": 0.0, "completion_prune_rate": 0.0},
    "dppo_paper (the paper's rule)": {},
    "dppo (the default: posterior dense + length 1.0 sorted)": {
        "prompt_scheme": "posterior", "prompt_prune_rate": 0.5, "dense_prompts": True, "completion_scheme": "length",
        "length_exponent": 1.0, "fixed_size_design": "sorted"},
    "completions only, proportional": {"prompt_prune_rate": 0.0},
    "completions only, proportional, sorted": {"prompt_prune_rate": 0.0, "fixed_size_design": "sorted"},
    "completions only, proportional, pivotal": {"prompt_prune_rate": 0.0, "fixed_size_design": "pivotal"},
    "completions only, paper": {"prompt_prune_rate": 0.0, "completion_scheme": "paper"},
    "completions only, length 0.5, sorted": {"prompt_prune_rate": 0.0, "completion_scheme": "length",
                                             "fixed_size_design": "sorted"},
    "completions only, length 1.0, sorted": {"prompt_prune_rate": 0.0, "completion_scheme": "length",
                                             "length_exponent": 1.0, "fixed_size_design": "sorted"},
    "completions only, rate 0.3, sorted": {"prompt_prune_rate": 0.0, "completion_prune_rate": 0.3,
                                           "fixed_size_design": "sorted"},
    "prompts only, paper 0.8": {"completion_prune_rate": 0.0},
    "prompts only, posterior 0.3": {"completion_prune_rate": 0.0, "prompt_scheme": "posterior",
                                    "prompt_prune_rate": 0.3},
    "prompts only, posterior dense": {"completion_prune_rate": 0.0, "prompt_scheme": "posterior",
                                      "prompt_prune_rate": 0.5, "dense_prompts": True},
    "posterior dense + proportional sorted": {"prompt_scheme": "posterior", "prompt_prune_rate": 0.5,
                                              "dense_prompts": True, "fixed_size_design": "sorted"},
    "dppo, completion rate 0.75": {
        "prompt_scheme": "posterior", "prompt_prune_rate": 0.5, "dense_prompts": True, "completion_scheme": "length",
        "length_exponent": 1.0, "fixed_size_design": "sorted", "completion_prune_rate": 0.75},
    "completions only, length 1.0, sorted, rate 0.75": {"prompt_prune_rate": 0.0, "completion_scheme": "length",
                                                        "length_exponent": 1.0, "fixed_size_design": "sorted",
                                                        "completion_prune_rate": 0.75},
    "posterior dense + target ESS 48, sorted": {"prompt_scheme": "posterior", "prompt_prune_rate": 0.5,
                                                "dense_prompts": True, "completion_prune_rate": 0.75,
                                                "completion_target_ess": 48, "fixed_size_design": "sorted"},
    "posterior dense + length sorted": {"prompt_scheme": "posterior", "prompt_prune_rate": 0.5, "dense_prompts": True,
                                        "completion_scheme": "length", "fixed_size_design": "sorted"},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timing_model(path: Path) -> dict:
    """Seconds per rolled-out prompt and per trained completion token, from grpo_skip's runs in a bench.json."""
    data = json.loads(path.read_text())
    m = data["methods"]["grpo_skip"]
    prompts = m["steps"] * 32
    return {"source": str(path), "s_per_prompt": m["phase_s"]["rollout"] / prompts,
            "s_per_token": m["phase_s"]["update"] / m["tokens"]["trained"]}


class Candidates:
    """``n`` prompts with a history, rolled out once more; every completion's gradient on μ's scale."""

    def __init__(self, trainer: DPPOTrainer, index: int, n: int, history_rollouts: int):
        c = trainer.config
        self.rows = trainer.prompts.sample(c.seed, 10_000 + index, n)
        self.ids = [prompt_key(r) for r in self.rows]
        for h in range(history_rollouts):
            step = 20_000 + 100 * index + h
            past = trainer.generate(step, self.rows)
            r = trainer.score(self.rows, past)
            trainer.estimator.observe(self.ids, r, group_advantages(r, c.scale_rewards), step)
        self.step = 20_000 + 100 * index + history_rollouts
        self.batch = trainer.generate(30_000 + index, self.rows)
        self.rewards = trainer.score(self.rows, self.batch)
        self.adv = group_advantages(self.rewards, c.scale_rewards)
        self.P, self.G = self.adv.shape
        self.lengths = torch.tensor([[len(x.token_ids) for x in g.completions] for g in self.batch.groups])
        flat_adv, flat_len = self.adv.flatten(), self.lengths.flatten()
        self.items = [j for j in range(self.P * self.G) if flat_adv[j] != 0 and flat_len[j] > 0]
        self.item_prompt = torch.tensor([j // self.G for j in self.items])
        self.item_len = flat_len[self.items].double()
        # per_completion_grads uses the full batch's normaliser P G: times P puts each on μ's scale (normaliser G)
        g = per_completion_grads(trainer, self) * self.P
        self.K = gram(g)
        del g
        onehot = torch.zeros(len(self.items), self.P, dtype=torch.float64)
        onehot[torch.arange(len(self.items)), self.item_prompt] = 1.0
        self.onehot = onehot
        s_gram = onehot.T @ self.K @ onehot  # S̃_q · S̃_r
        self.sigma2 = float((s_gram.trace() - s_gram.sum() / self.P) / (self.P - 1))
        self.mean_norm2 = float(s_gram.sum() / self.P**2)  # ‖ḡ‖², ḡ the candidates' mean S̃_q

    def full_sequences(self, trainer: DPPOTrainer):  # what per_completion_grads reads
        return trainer.sequences(self.batch, *trainer.weigh(None, None, torch.tensor(self.batch.lengths()), 0,
                                                         advantages=self.adv, observe=False))

    def draw(self, estimator, m: int, size: int) -> tuple[int, torch.Tensor, int, float]:
        """One draw: the window W, item weights u over the window's items, prompts rolled out, tokens trained.

        Every draw is at the same step (so the history reads the same), with its own random stream (the
        estimator's seed is the draw's index: the pruning draws are a function of (seed, step))."""
        estimator.seed, step = m, self.step + 1
        sel = estimator.select(self.ids, step, size=size)
        window = sel.window
        adv = self.adv[sel.indices]
        if getattr(estimator, "needs_lengths", False):
            weighting = estimator.weigh(adv, sel, step, lengths=self.lengths[sel.indices])
        else:
            weighting = estimator.weigh(adv, sel, step)
        w = torch.zeros(self.P, self.G, dtype=torch.float64)
        keep = torch.zeros(self.P, self.G, dtype=torch.bool)
        if sel.indices:
            w[sel.indices] = weighting.weights * weighting.keep.to(torch.float64)
            keep[sel.indices] = weighting.keep
        u = w.flatten()[self.items]
        tokens = float((self.lengths * keep).sum())
        return window, u, len(sel.indices), tokens


def measure(cands: Candidates, estimator, draws: int, size: int, timing: dict) -> dict:
    windows, quads, prompts, tokens = set(), [], [], []
    for m in range(draws):
        window, u, n_prompts, n_tokens = cands.draw(estimator, m, size)
        windows.add(window)
        in_window = (cands.item_prompt < window).double()
        d = (u - in_window)  # pruned minus full, over the window's items (0 outside it)
        quads.append(float(d @ cands.K @ d) / window**2)
        prompts.append(n_prompts)
        tokens.append(n_tokens)
    assert len(windows) == 1, "the window is fixed before the draw"
    window = windows.pop()
    v_prune = statistics.fmean(quads)
    v_data = cands.sigma2 / window
    cost = timing["s_per_prompt"] * statistics.fmean(prompts) + timing["s_per_token"] * statistics.fmean(tokens)
    return {"window": window, "prompts": statistics.fmean(prompts), "tokens": statistics.fmean(tokens),
            "v_data": v_data, "v_prune": v_prune, "v_total": v_data + v_prune, "cost_s": cost,
            "v_x_cost": (v_data + v_prune) * cost, "rel_noise": (v_data + v_prune) / cands.mean_norm2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/variance_cost.json"))
    parser.add_argument("--preset", default="cpu-baselines")
    parser.add_argument("--candidates", type=int, default=96,
                        help="candidate prompts per batch (dense windows need more than 32)")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--history-rollouts", type=int, default=2)
    parser.add_argument("--warm-steps", type=int, default=10)
    parser.add_argument("--draws", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timing", type=Path, default=Path("benchmarks/results/cpu-baselines/bench.json"))
    args = parser.parse_args()
    command = "python benchmarks/variance_cost.py " + shlex.join(sys.argv[1:])
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    preset = bench_preset(args.preset)
    tmp = tempfile.mkdtemp(prefix="variance-cost-")
    shared = ["eval_steps=0", "save_steps=0"]
    grpo = method_config(preset, "grpo", args.seed, tmp, shared)
    dppo = method_config(preset, "dppo_paper", args.seed, tmp, shared)
    size = grpo.prompts_per_step
    timing = timing_model(args.timing)
    trainer = DPPOTrainer(grpo, progress=False)
    trainer.engine = trainer.make_engine()
    log(f"{sum(p.numel() for p in trainer_params(trainer))} parameters; timing model {timing}")
    for _ in range(args.warm_steps):
        rec = trainer.train_step()
        log(f"warm step {rec['step']}: reward {rec['reward_mean']:.3f}")
    configs = {name: dppo.with_overrides(over) for name, over in SCHEMES.items()}
    results: dict[str, list[dict]] = {name: [] for name in SCHEMES}
    batches = []
    for b in range(args.batches):
        t = time.perf_counter()
        cands = Candidates(trainer, b, args.candidates, args.history_rollouts)
        info = {"candidates": cands.P, "items": len(cands.items), "sigma2": cands.sigma2,
                "mean_grad_norm2": cands.mean_norm2,
                "zero_std_groups": float((cands.rewards.std(1) == 0).float().mean()),
                "seconds": round(time.perf_counter() - t, 1)}
        batches.append(info)
        log(f"batch {b}: {info}")
        history = trainer.estimator.history
        for name, cfg in configs.items():
            from dppo_core.estimator import make_estimator
            est = make_estimator(cfg)
            est.history = history
            history.half_life = getattr(est, "posterior_half_life", None)
            r = measure(cands, est, args.draws, size, timing)
            results[name].append(r)
            log(f"  {name}: {r}")
    ref = statistics.fmean(r["v_x_cost"] for r in results["grpo_skip"])
    table = {}
    for name, rows in results.items():
        mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
        mean["v_x_cost_rel"] = statistics.fmean(r["v_x_cost"] for r in rows) / ref
        mean["per_batch_v_x_cost_rel"] = [r["v_x_cost"] / s["v_x_cost"]
                                          for r, s in zip(rows, results["grpo_skip"], strict=True)]
        mean["overrides"] = SCHEMES[name]
        table[name] = mean
    report = {"command": command, "preset": args.preset, "args": {k: str(v) for k, v in vars(args).items()},
              "timing_model": timing, "batches": batches, "schemes": table,
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Variance per unit of cost, {args.preset} setting", "", f"Command: `{command}`", "",
             f"{args.batches} batches of {args.candidates} candidate prompts, {args.draws} draws per scheme and batch; "
             f"cost model {timing['s_per_prompt']:.4f} s per rolled-out prompt + {timing['s_per_token'] * 1e6:.0f} µs "
             "per trained token (grpo_skip's phases in the timing file). V = data noise σ²/W + pruning noise; "
             "V × cost relative to grpo_skip (< 1: more certainty per second; per batch in brackets).", "",
             "| scheme | window | prompts | tokens | data noise / ‖ḡ‖² | pruning noise / ‖ḡ‖² | cost s "
             "| V × cost vs grpo_skip |",
             "|---|---|---|---|---|---|---|---|"]
    norm = statistics.fmean(b["mean_grad_norm2"] for b in batches)
    for name, r in table.items():
        per = ", ".join(f"{x:.2f}" for x in r["per_batch_v_x_cost_rel"])
        lines.append(f"| {name} | {r['window']:.0f} | {r['prompts']:.1f} | {r['tokens']:.0f} | "
                     f"{r['v_data'] / norm:.3f} | "
                     f"{r['v_prune'] / norm:.3f} | {r['cost_s']:.2f} | {r['v_x_cost_rel']:.2f} ({per}) |")
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
