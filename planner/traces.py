"""Seeded synthetic serving traces for the simulator.

Each generator returns a :class:`Trace`: an ordered list of prompts (tuples of token ids) as a
server would receive them. Token ids below :data:`FIRST_TEXT_ID` are chat-template tokens; the
rest are drawn at random, so two prompts share a prefix only where the generator makes them.

The chat template appends a generation suffix to every prompt (the assistant header plus an
empty think block) that the rendered history of a later turn does not repeat: the history
keeps the assistant header but not the think block. A follow-up therefore leaves the earlier
prompt :data:`DIVERGING_SUFFIX` tokens before its end, inside its last block or one below.

A trace is held whole: a generator whose sizes could draw more than :data:`MAX_TRACE_TOKENS`
tokens (bounded from its arguments, with every length at the top of its range) is refused
before it draws any.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ._checks import check_int, check_size

# Template token ids.
ROLE_START, SYSTEM, USER, ASSISTANT, TOOL, NEWLINE, TURN_END, THINK_OPEN, THINK_CLOSE = range(9)
FIRST_TEXT_ID = 16

ASSISTANT_HEADER = (ROLE_START, ASSISTANT, NEWLINE)
EMPTY_THINK = (THINK_OPEN, NEWLINE, THINK_CLOSE, NEWLINE)
GENERATION_SUFFIX = ASSISTANT_HEADER + EMPTY_THINK
DIVERGING_SUFFIX = len(EMPTY_THINK)
# About 0.8 GB of tuple slots; the default traces hold about 0.8 million tokens per scale step.
MAX_TRACE_TOKENS = 100_000_000


@dataclass(frozen=True)
class Trace:
    """A named, ordered list of prompts."""

    name: str
    description: str
    requests: tuple[tuple[int, ...], ...]

    def __iter__(self):
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all prompts."""
        return sum(len(request) for request in self.requests)


def multi_turn_chat(
    *,
    conversations: int = 4,
    turns: int = 8,
    system_tokens: int = 2000,
    message_tokens: tuple[int, int] = (40, 600),
    reply_tokens: tuple[int, int] = (200, 2000),
    vocab_size: int = 32000,
    seed: int = 0,
) -> Trace:
    """Chats, turns interleaved across conversations.

    Turn k's prompt is the history (system prompt, then user and assistant turns) plus the
    new user message plus the generation suffix; turn k + 1 extends the history with turn k's
    message, its reply and a new message. Lengths are drawn uniformly from the (low, high)
    ranges; each conversation has its own system prompt.
    """
    rng = _rng(seed, vocab_size)
    check_size(f"the tokens of {conversations} chats x {turns} turns",
               _chat_tokens(conversations, turns, system_tokens, message_tokens, reply_tokens),
               MAX_TRACE_TOKENS, "lower conversations, turns or the token counts")
    histories = [
        [ROLE_START, SYSTEM, NEWLINE, *_text(rng, system_tokens, vocab_size), TURN_END]
        for _ in range(conversations)
    ]
    requests = []
    for _ in range(turns):
        for history in histories:
            message = _text(rng, rng.randint(*message_tokens), vocab_size)
            history += [ROLE_START, USER, NEWLINE, *message, TURN_END]
            requests.append(tuple(history) + GENERATION_SUFFIX)
            reply = _text(rng, rng.randint(*reply_tokens), vocab_size)
            history += [*ASSISTANT_HEADER, *reply, TURN_END]
    return Trace(
        name="chat",
        description=f"{conversations} multi-turn chats x {turns} turns",
        requests=tuple(requests),
    )


def shared_system_prompts(
    *,
    requests: int = 40,
    system_prompts: int = 3,
    system_tokens: tuple[int, int] = (3000, 12000),
    user_tokens: tuple[int, int] = (20, 400),
    vocab_size: int = 32000,
    seed: int = 0,
) -> Trace:
    """Single-turn requests, each one of a few long system prompts (chosen uniformly) plus a
    short user message."""
    rng = _rng(seed, vocab_size)
    check_size(f"the tokens of {requests} requests over {system_prompts} system prompts",
               _system_tokens(requests, system_prompts, system_tokens, user_tokens),
               MAX_TRACE_TOKENS, "lower requests, system_prompts or the token counts")
    systems = [
        (ROLE_START, SYSTEM, NEWLINE, *_text(rng, rng.randint(*system_tokens), vocab_size),
         TURN_END)
        for _ in range(system_prompts)
    ]
    prompts = []
    for _ in range(requests):
        message = _text(rng, rng.randint(*user_tokens), vocab_size)
        prompts.append(
            rng.choice(systems) + (ROLE_START, USER, NEWLINE, *message, TURN_END)
            + GENERATION_SUFFIX
        )
    return Trace(
        name="system",
        description=f"{requests} requests over {system_prompts} shared system prompts",
        requests=tuple(prompts),
    )


def agentic_branching(
    *,
    contexts: int = 3,
    branches: int = 4,
    context_tokens: tuple[int, int] = (6000, 30000),
    continuation_tokens: tuple[int, int] = (50, 800),
    vocab_size: int = 32000,
    seed: int = 0,
) -> Trace:
    """Agents that fork: each context is continued ``branches`` times (a tool call and its
    result), and the requests of all contexts arrive interleaved in random order (the
    branches of one context in order)."""
    rng = _rng(seed, vocab_size)
    check_size(f"the tokens of {contexts} agent contexts x {branches} branches",
               _agent_tokens(contexts, branches, context_tokens, continuation_tokens),
               MAX_TRACE_TOKENS, "lower contexts, branches or the token counts")
    pending = []
    for _ in range(contexts):
        context = (ROLE_START, SYSTEM, NEWLINE,
                   *_text(rng, rng.randint(*context_tokens), vocab_size), TURN_END)
        forks = []
        for _ in range(branches):
            call = _text(rng, rng.randint(*continuation_tokens), vocab_size)
            result = _text(rng, rng.randint(*continuation_tokens), vocab_size)
            forks.append(
                context + ASSISTANT_HEADER + (*call, TURN_END, ROLE_START, TOOL, NEWLINE,
                                              *result, TURN_END) + GENERATION_SUFFIX
            )
        pending.append(forks)
    prompts = []
    while pending:
        forks = rng.choice(pending)
        prompts.append(forks.pop(0))
        if not forks:
            pending.remove(forks)
    return Trace(
        name="agent",
        description=f"{contexts} agent contexts x {branches} branches",
        requests=tuple(prompts),
    )


def default_traces(seed: int = 0, scale: int = 1) -> list[Trace]:
    """The three traces at their default sizes, with ``scale`` times as many requests."""
    check_int("scale", scale, minimum=1)
    scaled = {multi_turn_chat: dict(conversations=4 * scale), shared_system_prompts: dict(requests=40 * scale),
              agentic_branching: dict(contexts=3 * scale)}
    # Bounded here, so that the refusal names scale rather than a count this caller never gave.
    check_size(f"the tokens of the default traces at scale {scale}",
               sum(_BOUNDS[make](**{**_sizes(make), **sizes}) for make, sizes in scaled.items()),
               MAX_TRACE_TOKENS, "lower scale")
    return [make(**sizes, seed=seed) for make, sizes in scaled.items()]


# Upper bounds on the tokens a generator draws and holds, every length at the top of its range
# (the template tokens around each text counted as in the generators). Each checks its sizes.

def _chat_tokens(conversations: int, turns: int, system_tokens: int, message_tokens: tuple[int, int],
                 reply_tokens: tuple[int, int]) -> int:
    check_int("conversations", conversations, minimum=1)
    check_int("turns", turns, minimum=1)
    check_int("system_tokens", system_tokens)
    message = _check_range("message_tokens", message_tokens) + 4
    reply = _check_range("reply_tokens", reply_tokens) + 4
    # Turn k's prompt: the system prompt, k messages, k - 1 replies and the generation suffix.
    per_chat = (turns * (system_tokens + 4 + len(GENERATION_SUFFIX))
                + message * turns * (turns + 1) // 2 + reply * turns * (turns - 1) // 2)
    return conversations * per_chat


def _system_tokens(requests: int, system_prompts: int, system_tokens: tuple[int, int],
                   user_tokens: tuple[int, int]) -> int:
    check_int("requests", requests, minimum=1)
    check_int("system_prompts", system_prompts, minimum=1)
    system = _check_range("system_tokens", system_tokens) + 4
    user = _check_range("user_tokens", user_tokens) + 4
    return system_prompts * system + requests * (system + user + len(GENERATION_SUFFIX))


def _agent_tokens(contexts: int, branches: int, context_tokens: tuple[int, int],
                  continuation_tokens: tuple[int, int]) -> int:
    check_int("contexts", contexts, minimum=1)
    check_int("branches", branches, minimum=1)
    context = _check_range("context_tokens", context_tokens) + 4
    continuation = _check_range("continuation_tokens", continuation_tokens)
    fork = context + len(ASSISTANT_HEADER) + 2 * continuation + 5 + len(GENERATION_SUFFIX)
    return contexts * (context + branches * fork)


_BOUNDS = {multi_turn_chat: _chat_tokens, shared_system_prompts: _system_tokens, agentic_branching: _agent_tokens}


def _sizes(make) -> dict:
    """A generator's default sizes: its keyword defaults less the seed and the vocabulary."""
    return {name: value for name, value in make.__kwdefaults__.items() if name not in ("seed", "vocab_size")}


def _rng(seed: int, vocab_size: int) -> random.Random:
    check_int("seed", seed)
    check_int("vocab_size", vocab_size, minimum=FIRST_TEXT_ID + 1)
    return random.Random(seed)


def _text(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return rng.choices(range(FIRST_TEXT_ID, vocab_size), k=count)


def _check_range(name: str, value: tuple[int, int]) -> int:
    """Check a (low, high) range of lengths; returns high."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"{name} must be a (low, high) tuple of ints, got {value!r}")
    low, high = value
    check_int(f"{name}[0]", low)
    check_int(f"{name}[1]", high)
    if low > high:
        raise ValueError(f"{name} must have low <= high, got {value!r}")
    return high
