"""Whether a request stops after a token: one pure function of the request and that token."""

from __future__ import annotations

from foudre.engine.request import Request, RequestStatus


def check_stop(
    req: Request, token: int, max_model_len: int
) -> tuple[RequestStatus, int | None] | None:
    """The status ``req`` finishes with now that ``token`` is its last output token, and the
    stop token to report (None for a length stop), or None while it goes on. Stop strings are
    the detokenizer's to find (they need text). Reads ``req``, changes nothing."""
    p = req.sampling_params
    n_out = len(req.output_token_ids)
    is_stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids)
    if is_stop_token and n_out >= p.min_tokens:
        return RequestStatus.FINISHED_STOPPED, token
    if req.grammar is not None and req.grammar.is_terminated:  # it took a stop token
        return RequestStatus.FINISHED_STOPPED, token
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
