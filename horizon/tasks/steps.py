"""The steps domain: "start at a and add s, k times": the thought holds every intermediate result.

"Start at 17 and add 3 to it 12 times. What number do you reach?" The reference thought restates the
task, then writes each step with the steps left ("From 17, add 3, 12 times: 20 (11 left), 23 (10 left),
..., 53 (0 left). The result is 53."). After the restatement (three values copied from the question)
every token is a small local computation (the last value plus s, the steps left minus one, stop at 0),
and the answer is the last value. Its length grows with k, about 11 tokens a step. Computing a + k·s in
one step is beyond a small model, and a thought cut short by the tier's budget stops before step k and
leaves a guess: this is the domain where thinking tokens should rise with the tier and accuracy with them
(issue 32's "thinking helps" side).

Values: a in 1-99, s in 2-9, k in 2-40 (so a result is at most 459).

Split rule (the held-out value space): a task is held out when the CRC-32 of "a,s,k" is a multiple of 5.
Seeds are disjoint as in every domain (``Domain.rng``).

Key (de-duplication): (a, s, k).

Reward: 1.0 if the first integer in the completion (``base.first_int``) is a + k·s, else 0.0.
"""

from __future__ import annotations

import zlib

from horizon.tasks.base import Domain, Task, assistant_message, int_reward

HELDOUT_MOD = 5
MAX_START, STRIDES, MIN_STEPS, MAX_STEPS = 99, (2, 9), 2, 40
QUESTIONS = ("Start at {a} and add {s} to it {k} times. What number do you reach?",
             "Begin with {a}. Add {s}, {k} times in a row. What is the result?")


def steps_heldout(a: int, s: int, k: int) -> bool:
    return zlib.crc32(f"{a},{s},{k}".encode()) % HELDOUT_MOD == 0


class StepsDomain(Domain):
    name = "steps"
    tools = ()

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        heldout = split == "heldout"
        while True:  # rejection: about one draw in five is held out
            a, s, k = rng.randint(1, MAX_START), rng.randint(*STRIDES), rng.randint(MIN_STEPS, MAX_STEPS)
            if steps_heldout(a, s, k) == heldout:
                break
        answer = str(a + k * s)
        walked = ", ".join(f"{a + i * s} ({k - i} left)" for i in range(1, k + 1))
        reasoning = f"From {a}, add {s}, {k} times: {walked}. The result is {answer}."
        prompt = rng.choice(QUESTIONS).format(a=a, s=s, k=k)
        return self.task(seed, split, prompt, answer, [assistant_message(answer, reasoning)],
                         {"start": a, "stride": s, "steps": k})

    def reward(self, task: Task, completion: str) -> float:
        return int_reward(task, completion)

    def key(self, task: Task) -> str:
        return f"steps:{task.meta['start']},{task.meta['stride']},{task.meta['steps']}"
