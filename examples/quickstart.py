"""Capture SSM states inside one prefill pass, then resume from one of them bit-exactly.

Run: python examples/quickstart.py
"""
import torch

from ssm_kernels import mamba2_scan


def main():
    torch.manual_seed(0)
    seqlen, nheads, headdim, ngroups, dstate = 200, 8, 16, 1, 32
    x = torch.randn(1, seqlen, nheads, headdim)
    dt = torch.randn(1, seqlen, nheads)
    A = -torch.rand(nheads) - 0.5
    B = torch.randn(1, seqlen, ngroups, dstate)
    C = torch.randn(1, seqlen, ngroups, dstate)
    # The recurrent scan resumes bit for bit at any position (README: "Semantics and exactness");
    # the default, "auto", may pick another algorithm for each pass on a GPU.
    opts = dict(D=torch.randn(nheads), dt_bias=torch.randn(nheads), dt_softplus=True, algorithm="recurrent")

    # One pass over the prompt, capturing the state at three block boundaries on the way.
    offsets = [64, 128, 192]
    cold = mamba2_scan(x, dt, A, B, C, **opts, capture=[(0, k) for k in offsets])
    print(f"one pass of {seqlen} tokens, states captured at {offsets}: "
          f"captured_states {tuple(cold.captured_states.shape)}")

    # A later request shares the first 192 tokens: restore there and compute only the rest.
    k = offsets[-1]
    warm = mamba2_scan(x[:, k:], dt[:, k:], A, B[:, k:], C[:, k:], **opts,
                       initial_states=cold.captured_states[2:3])
    same_y = torch.equal(warm.y, cold.y[:, k:])
    same_state = torch.equal(warm.final_states, cold.final_states)
    print(f"resumed at {k}, computed {seqlen - k} tokens: y bit-identical {same_y}, "
          f"final state bit-identical {same_state}")
    if not (same_y and same_state):
        raise SystemExit("resuming from a captured state changed the result")


if __name__ == "__main__":
    main()
