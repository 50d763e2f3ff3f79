"""Chat templates render within a budget: loop steps and built sizes counted in the sandbox, and, in
the router's template pool, worker processes killed at a deadline or past their memory, while other
templates keep rendering."""
import asyncio
import os
import time

import pytest

from router.errors import TemplateError
from router.inputs.chat_template import ChatTemplate
from router.inputs.template_budget import RenderBudget, TemplateBudgetError
from router.inputs.template_pool import RenderLimits, TemplatePool
from router.inputs.template_worker import encode_job

ASK = [{"role": "user", "content": "hi"}]
PLAIN = "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}"
# each step joins 100,000 numbers: few steps, each slow, so only the deadline stops it
SLOW = "{% for i in range(100000) %}{{ range(100000) | join | length }}{% endfor %}"


@pytest.mark.parametrize("source,message", [
    ("{% for i in range(5000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}",
     "looped more than 1,000,000 times"),
    ("{% set s = 'a' * 100000000 %}", "built a value of 100,000,000 characters"),
    ("{% set ns = namespace(s='a' * 1000000) %}{% for i in range(9) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "built a value of 16,000,000 characters"),
    ("{{ 7 ** 100000000 }}", "computed a number of more than 4096 bits"),
    ("{% for i in range(100) %}{{ 'a' * 100000 }}{% endfor %}", "rendered 10,000,000 characters"),
])
def test_a_template_past_its_steps_or_sizes_fails_at_once(source, message):
    started = time.monotonic()
    with pytest.raises(TemplateBudgetError, match=message) as err:
        ChatTemplate(source).render(ASK)
    assert err.value.status == 422 and err.value.error_type == "template_error"
    assert time.monotonic() - started < 1.0


def test_the_levels_of_a_recursive_loop_count_too():
    template = ChatTemplate("{% for i in range(3) recursive %}{% if loop.depth < 6 %}"
                            "{{ loop(range(100)) }}{% endif %}{% endfor %}",
                            budget=RenderBudget(max_steps=10_000))  # 100^5 steps otherwise
    with pytest.raises(TemplateBudgetError, match="looped more than 10,000 times"):
        template.render(ASK)


def test_nothing_is_computed_when_a_template_compiles():
    started = time.monotonic()
    for source in ("{{ 'a' * 10**10 }}", "{{ 'a' | center(300000000) }}", "{{ 9 ** 10**10 }}",
                   "{% set s = 'a' | center(300000000) %}{{ s | length }}"):
        assert ChatTemplate(source).error is None
    assert "autoescape takes a literal" in ChatTemplate(
        "{% autoescape 'a' | center(300000000) %}{% endautoescape %}").error
    assert ChatTemplate("{% autoescape false %}<{{ m }}>{% endautoescape %}").render(
        [], extra={"m": "&"}) == "<&>"
    assert time.monotonic() - started < 0.5


def test_counted_loops_keep_what_loops_know():
    template = ChatTemplate(
        "{% for m in messages if m.content %}{{ loop.index }}/{{ loop.length }}"
        "{% if loop.last %}!{% endif %}{{ loop.revindex }} {% endfor %}"
        "{% for x in [] %}x{% else %}empty{% endfor %}", budget=RenderBudget(max_steps=3))
    messages = [{"role": "user", "content": c} for c in ("a", "", "b")]
    assert template.render(messages) == "1/22 2/2!1 empty"
    with pytest.raises(TemplateBudgetError):
        template.render(messages * 2)  # the budget is a render's, counted afresh each time


def _job(template: ChatTemplate, content: str = "hi") -> bytes:
    return encode_job(template.source,
                      template.variables([{"role": "user", "content": content}]))


async def _timed(pool: TemplatePool, template: ChatTemplate, job: bytes):
    started = time.monotonic()
    try:
        return await pool.render(template, job), time.monotonic() - started
    except TemplateError as err:
        return err, time.monotonic() - started


async def test_a_slow_template_is_stopped_at_its_deadline_while_others_render(monkeypatch):
    from router.inputs import template_pool

    # as if its worker had a core all its render long (on a loaded test machine it may not)
    monkeypatch.setattr(template_pool._Worker, "cpu_seconds", lambda self: time.monotonic())
    pool = TemplatePool(RenderLimits(RenderBudget(), seconds=0.5), size=2)
    plain, slow = ChatTemplate(PLAIN), ChatTemplate(SLOW)
    try:
        pool.start()
        assert (await pool.render(plain, _job(plain))) == "user:hi\n"
        # three of its chats at once: it holds two of the three workers, the third chat waits,
        # then is refused with the first ones' failure, without a render
        hostile = asyncio.gather(*(_timed(pool, slow, _job(slow)) for _ in range(3)))
        others = []
        while not hostile.done():
            others.append(await _timed(pool, plain, _job(plain, f"{len(others)}")))
        (first, first_s), (both, both_s), (second, second_s) = await hostile
        for error, took in ((first, first_s), (both, both_s)):
            assert isinstance(error, TemplateBudgetError)
            assert error.message == "the chat template did not render within its 0.5 s"
            assert 0.5 <= took < 1.5
        assert isinstance(second, TemplateBudgetError)
        assert "refused without rendering" in str(second)
        assert second_s < 1.5
        assert len(others) > 5 and all(text == f"user:{i}\n" and took < 0.3
                                       for i, (text, took) in enumerate(others))
        # a smaller chat of the same template is still tried; a larger one is refused at once
        assert "refused" not in str((await _timed(pool, slow, encode_job(SLOW, {})))[0])
        refused, took = await _timed(pool, slow, _job(slow, "a longer message"))
        assert "refused without rendering" in str(refused) and took < 0.1
        assert (await pool.render(plain, _job(plain))) == "user:hi\n"  # the workers came back
    finally:
        await pool.close()


async def test_a_template_past_its_memory_fails_and_its_worker_is_replaced():
    pool = TemplatePool(RenderLimits(RenderBudget(), memory_bytes=64 << 20), size=2)
    greedy, plain = ChatTemplate("{{ 'a' | center(300000000) }}"), ChatTemplate(PLAIN)
    try:
        error, took = await _timed(pool, greedy, _job(greedy))
        assert isinstance(error, TemplateBudgetError), error
        assert error.message == "the chat template used more memory than a render may"
        for _ in range(3):  # both workers, the new one too
            assert (await pool.render(plain, _job(plain))) == "user:hi\n"
    finally:
        await pool.close()


async def test_a_render_whose_client_left_never_answers_another():
    pool = TemplatePool(RenderLimits(RenderBudget()), size=2)
    busy = ChatTemplate("{% for i in range(200000) %}{% endfor %}busy")
    plain = ChatTemplate(PLAIN)
    try:
        for _ in range(3):
            left = asyncio.ensure_future(pool.render(busy, _job(busy)))
            await asyncio.sleep(0.01)
            left.cancel()
            answers = await asyncio.gather(*(pool.render(plain, _job(plain, str(i)))
                                             for i in range(4)))
            assert answers == [f"user:{i}\n" for i in range(4)]
    finally:
        await pool.close()


async def test_a_template_out_of_time_for_want_of_cpu_is_tried_again(monkeypatch):
    """On a busy machine a render may pass its time without its worker getting the CPU: the
    template is then not remembered as failing."""
    from router.inputs import template_pool

    monkeypatch.setattr(template_pool._Worker, "cpu_seconds", lambda self: 0.0)
    pool = TemplatePool(RenderLimits(RenderBudget(), seconds=0.3), size=3)
    slow = ChatTemplate(SLOW)
    try:
        for _ in range(2):
            error, took = await _timed(pool, slow, _job(slow))
            assert error.message == "the chat template did not render within its 0.3 s"
            assert took >= 0.3, "tried again, not refused without rendering"
    finally:
        await pool.close()


async def test_workers_run_below_the_shards_priority():
    """A template spending its whole budget must not take a core from the shards."""
    from pathlib import Path

    pool = TemplatePool(RenderLimits(RenderBudget()), size=2)
    try:
        plain = ChatTemplate(PLAIN)
        assert (await pool.render(plain, _job(plain))) == "user:hi\n"
        expected = min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
        for _ in range(100):  # the others may still be starting: a worker lowers itself first
            workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                       and b"router.inputs.template_worker" in _cmdline(p)
                       and _parent(p) == os.getpid()]
            priorities = [os.getpriority(os.PRIO_PROCESS, pid) for pid in workers]
            if len(workers) == pool.size and set(priorities) == {expected}:
                break
            await asyncio.sleep(0.05)
        assert len(workers) == pool.size and set(priorities) == {expected}
    finally:
        await pool.close()


def _cmdline(proc) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _parent(proc) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


async def test_a_chat_is_answered_when_no_worker_can_start(monkeypatch):
    """Workers that fail to start (a broken environment, no memory for a process) make chats fail
    with a 503 naming why, not wait without bound; the pool serves again once one starts."""
    from router.errors import UnhealthyError
    from router.inputs import template_pool

    spawn = TemplatePool._spawn

    async def broken(self):
        raise OSError("no such interpreter")

    monkeypatch.setattr(template_pool, "_RESTART_DELAY_S", 0.05)
    monkeypatch.setattr(TemplatePool, "_spawn", broken)
    pool = TemplatePool(RenderLimits(RenderBudget()), size=3)
    plain = ChatTemplate(PLAIN)
    try:
        started = time.monotonic()
        with pytest.raises(UnhealthyError) as refused:
            await pool.render(plain, _job(plain))
        assert refused.value.status == 503 and time.monotonic() - started < 5
        assert "no such interpreter" in refused.value.message
        monkeypatch.setattr(TemplatePool, "_spawn", spawn)
        for _ in range(100):
            try:
                assert (await pool.render(plain, _job(plain))) == "user:hi\n"
                break
            except UnhealthyError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the pool never served again")
    finally:
        await pool.close()
