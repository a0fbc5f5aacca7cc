"""What one inference call of the acting loop costs on a device, by batch size, eager and from CUDA graphs.

    python benchmarks/act_cost.py --device cuda --batches 32 64 128 256 512 896

Per batch size (envs in one call of `oni_appo.act`): act's sequence (observations to the device, the GRU
state's reset, the policy's step, Gumbel-max sampling with CPU noise, actions and log-probs back) with
`Agent.step` and with `Agent.fast_step` (the step replayed from the CUDA graph captured for that batch size,
as act calls it), then the two steps alone, and the largest difference between their outputs. Median of
--repeats timed calls after a warm-up, each ended by a synchronize. Random observations of the real shapes;
the policy is oni_appo.Agent, untrained. On a GPU node `act` bounded the pipeline (benchmarks/README.md, On a
GPU node): an eager step of a small batch costs its ~90 kernel launches whatever its size.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
import oni_appo  # noqa: E402


def timed(fn, device, repeats):
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256, 512, 896])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    agent = oni_appo.Agent().to(device).eval()
    print(f"{args.device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
          f"us per call, median of {args.repeats}")
    print("| envs a call | act's sequence, eager | act's sequence, CUDA graph | Agent.step | Agent.fast_step "
          "(CUDA graph) | fast_step vs step | max abs diff |\n|---|---|---|---|---|---|---|")
    cuda = device.type == "cuda"
    for n in args.batches:
        host = {"chars": torch.randint(32, 127, (n, 21, 79), dtype=torch.uint8),
                "colors": torch.randint(0, 16, (n, 21, 79), dtype=torch.uint8),
                "blstats": torch.randint(0, 20, (n, 27)).float(),
                "message": torch.randint(0, 127, (n, envs.MESSAGE_LEN), dtype=torch.uint8)}
        hidden, ends, generator = (torch.zeros(n, 512, device=device), torch.zeros(n, dtype=torch.int8),
                                   np.random.default_rng(0))
        obs = {k: v.to(device) for k, v in host.items()}

        # oni_appo.act for one batch as one slot: the policy and sampling, not its buffers and pipes
        @torch.no_grad()
        def act(step):
            o = {k: v.to(device) for k, v in host.items()}
            logits, _, h_new = step(o, oni_appo.carry_state(hidden, ends.to(device)))
            log_probs = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
            noise = generator.random(log_probs.shape, np.float32)
            action = (log_probs - np.log(-np.log(np.maximum(noise, 1e-20)))).argmax(-1)
            return action, log_probs[np.arange(n), action], h_new

        with torch.no_grad():
            row = [timed(lambda: act(agent.step), device, args.repeats),
                   timed(lambda: act(agent.fast_step), device, args.repeats) if cuda else None,
                   timed(lambda: agent.step(obs, hidden), device, args.repeats),
                   timed(lambda: agent.fast_step(obs, hidden), device, args.repeats) if cuda else None]
            diff = max((a - b).abs().max().item()
                       for a, b in zip(agent.fast_step(obs, hidden), agent.step(obs, hidden)))
        cells = ["n/a" if t is None else f"{t:,.0f} ({t / n:.1f}/env)" for t in row]
        ratio = f"{row[2] / row[3]:.1f}x" if cuda else "n/a"
        print(f"| {n} | " + " | ".join(cells) + f" | {ratio} | {diff:.1e} |", flush=True)

if __name__ == "__main__":
    main()
