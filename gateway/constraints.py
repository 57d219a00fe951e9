"""Checks a request's output constraint (JSON schema, regex, choice, grammar) before admission, so a
constraint the engine could not enforce is a precise INVALID_ARGUMENT, not a failed stream.

Checking builds the grammar against the model's tokenizer (milliseconds; llguidance's fuel limits
bound the worst), on a thread of its own so the event loop never runs it. Verdicts are kept per tenant
and constraint digest: a tenant's agent sending the same schema a thousand times pays once, and no
tenant can learn from timing what another's requests held. A check that outlasts its deadline is a
refusal ("too costly"), whatever it would have concluded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict
from collections.abc import Iterable

from gateway.errors import invalid_argument
from protocol.limits import Violation
from protocol.structured import Constraint, grammar_tokenizer, grammar_violations, size_violations
from protocol.tokenizer import Tokenizer

_KEPT_VERDICTS = 1024

# Two threads: a tenant's costly schema being checked leaves one for everyone else's.
_CHECK_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="loom-grammar-check")


class ConstraintChecks:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # What is wrong, without the field: the same constraint may come in another field next time.
        self._verdicts: OrderedDict[tuple[str, str, int], list[str]] = OrderedDict()

    def warm(self, tokenizers: Iterable[Tokenizer]) -> None:
        """Build each model's grammar view of its tokenizer now, on a check thread (about 0.2 s and
        20 MB for a 49k vocabulary), rather than in the first constrained request's check."""
        for tokenizer in {id(t): t for t in tokenizers}.values():
            _CHECK_THREADS.submit(grammar_tokenizer, tokenizer)

    async def check(self, tenant_id: str, tokenizer: Tokenizer, constraint: Constraint) -> None:
        """Raise GatewayError(INVALID_ARGUMENT) naming the request's field if ``constraint`` cannot
        be enforced for this model."""
        bad = size_violations(constraint)
        if not bad:
            key = (tenant_id, constraint.digest(), id(tokenizer))
            found = self._verdicts.get(key)
            if found is None:
                reasons, final = await self._run(tokenizer, constraint)
                found = [why for _, why in reasons]
                if final:  # a timeout may be the machine's moment, not the constraint's cost
                    self._verdicts[key] = found
                    while len(self._verdicts) > _KEPT_VERDICTS:
                        self._verdicts.popitem(last=False)
            else:
                self._verdicts.move_to_end(key)
            bad = [(constraint.field_name, why) for why in found]
        if bad:
            raise invalid_argument(bad)

    async def _run(self, tokenizer: Tokenizer, constraint: Constraint) -> tuple[list[Violation], bool]:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def work() -> list[Violation]:
            loop.call_soon_threadsafe(started.set)
            return grammar_violations(constraint, grammar_tokenizer(tokenizer))

        future = loop.run_in_executor(_CHECK_THREADS, work)
        # The deadline counts the check's own time, not its wait for a thread: another tenant's
        # checks ahead of it must not make this one "too costly".
        await started.wait()  # work() sets it first thing
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s), True
        except TimeoutError:
            slow = f"takes longer than {self.timeout_s:g} s to compile; simplify it"
            return [(constraint.field_name, slow)], False
