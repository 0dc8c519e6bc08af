"""Helpers shared by the engine and speculative-decoding tests (a uniquely named module in tests/, which is on
sys.path through its conftest: conftest names clash across test dirs)."""


def run_all(llm, prompts, params, record_logits=False):
    """add_request + step until done; returns ({req_id: RequestOutput}, {req_id: [logits rows]})."""
    logits = {}
    if record_logits:
        llm.runner.record_logits = True
        real = llm.runner.execute

        def spy(batch):
            out = real(batch)
            for rid, rows in (out.logits or {}).items():
                logits.setdefault(rid, []).append(rows)
            return out
        llm.runner.execute = spy
    try:
        for rid, prompt in prompts.items():
            llm.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
        done = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    done[out.req_id] = out
    finally:
        if record_logits:
            llm.runner.record_logits = False
            del llm.runner.execute
    return done, logits
