"""Verifiable training tasks: generated per domain, rendered in the chat format, scored by a reward.

    from horizon.tasks import check_disjoint, get_domain, make_split

    train = make_split("image", "train", 1000)
    heldout = make_split("image", "heldout", 200)
    check_disjoint(train, heldout)                  # ValueError naming shared keys, if any
    task = train[0]; task.messages, task.answer, task.target, task.tools
    reward = get_domain(task.domain).reward(task, completion)   # in [0, 1]

Files: ``base`` (Task, Domain, registry, splits, chat builders, answer parsing), one file per domain
(``image``, ``arithmetic``, ``passkey``, ``terminal``, ``convert``, ``recall``, ``steps``). Adding a
domain: a module with a ``Domain`` subclass and one ``register`` line below.
"""

from horizon.tasks.arithmetic import ArithmeticDomain
from horizon.tasks.base import (
    DOMAINS,
    SPLITS,
    Domain,
    Task,
    check_disjoint,
    first_int,
    get_domain,
    make_split,
    register,
)
from horizon.tasks.convert import ConvertDomain
from horizon.tasks.image import ImageDomain
from horizon.tasks.passkey import PasskeyDomain
from horizon.tasks.recall import RecallDomain
from horizon.tasks.steps import StepsDomain
from horizon.tasks.terminal import TerminalDomain, task_fs

register(ImageDomain())
register(ArithmeticDomain())
register(PasskeyDomain())
# ~200-500 tokens: about 4x the bundled model's index_topk (64), where sparse selection must find the key
register(PasskeyDomain(min_words=60, max_words=140, name="passkey-short"))
register(TerminalDomain())
register(ConvertDomain())
register(RecallDomain())  # the copying curriculum the bundled model starts with
register(StepsDomain())  # where a longer thought pays: every intermediate result written down

__all__ = [
    "DOMAINS",
    "SPLITS",
    "ArithmeticDomain",
    "ConvertDomain",
    "Domain",
    "ImageDomain",
    "PasskeyDomain",
    "RecallDomain",
    "StepsDomain",
    "Task",
    "TerminalDomain",
    "check_disjoint",
    "first_int",
    "get_domain",
    "make_split",
    "register",
    "task_fs",
]
