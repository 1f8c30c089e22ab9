"""What one try of drafting measured (Try): gamma=auto's Controller ends a try whose rounds took
longer than plain rounds would have for the tokens they committed, whatever its model of
acceptance predicts. That model can miss a drafter whose rounds seldom propose anything (prompt
lookup on text it does not copy): its few scored positions keep an optimistic estimate while
every round pays for the drafting (tests/test_autogamma.py)."""

import dataclasses

import numpy as np

# A try whose drafting rounds (TRY_ROUNDS at least) took LOSS_SHARE longer than plain rounds, as
# timed, would have for the tokens they committed ends.
LOSS_SHARE, TRY_ROUNDS = 0.05, 4


@dataclasses.dataclass
class Try:
    """The drafting rounds of one try (from the first drafting chunk, or a probe, on): rounds,
    their seconds, and the seconds plain rounds would have taken for the tokens they committed."""

    rounds: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0

    def lost(self, chunk, times: dict, active: int) -> bool:
        """Counts a drafting chunk (a controller.Chunk; times: the Controller's seconds per round
        by gamma, this chunk's included; active: its rows) and says whether the try has lost
        LOSS_SHARE of its time against plain rounds as timed. An arm's first chunk, which may be
        its program's first run, is left out, and nothing is said before a plain round was timed."""
        if 0 not in times or len(times.get(chunk.gamma, ())) < 2:
            return False
        self.rounds += chunk.rounds
        self.seconds += chunk.seconds
        self.plain_seconds += float(np.sum(chunk.committed_b)) / active * min(times[0])
        return self.rounds >= TRY_ROUNDS and self.plain_seconds < (1.0 - LOSS_SHARE) * self.seconds
