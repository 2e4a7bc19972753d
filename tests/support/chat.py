"""Comparing engine outputs, and driving chats over HTTP (a stream, or turns whose cached tokens
are read back)."""

from __future__ import annotations

import torch


def assert_same_output(a, b) -> None:
    """Two engine outputs are the same computation: equal tokens, logprobs within 1e-4 (fp32
    rounding of a different batch or split)."""
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                               torch.tensor([lp.logprob for lp in b.logprobs]), atol=1e-4, rtol=0)


def open_chat_stream(http, model: str, messages: list[dict], max_tokens: int = 1500):
    """A long streamed chat completion kept in flight (ignore_eos) until its response is closed:
    load a replica holds while a test routes around it. `http`: an httpx.Client on the server."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "messages": messages}
    return http.send(http.build_request("POST", "/v1/chat/completions", json=body), stream=True)


def chat_turns(client, model: str, system: str, questions: list[str]) -> tuple[list[int], list[int], set]:
    """A conversation through the official client, greedy, each answer echoed back with its
    reasoning as a chat app does: (prompt tokens, cached tokens) per turn, and the replicas
    (`cairn.cluster.ingress.REPLICA_HEADER`) that served it. `client` may be a list of clients: turn t
    goes through client[t % len(client)]."""
    from cairn.cluster.ingress import REPLICA_HEADER

    clients = client if isinstance(client, (list, tuple)) else [client]
    messages, prompts, cached, replicas = [{"role": "system", "content": system}], [], [], set()
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        raw = clients[turn % len(clients)].chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, temperature=0)
        out = raw.parse()
        prompts.append(out.usage.prompt_tokens)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        replicas.add(raw.headers.get(REPLICA_HEADER))
        message = out.choices[0].message
        messages.append({"role": "assistant", "content": message.content or "",
                         "reasoning_content": getattr(message, "reasoning_content", None) or ""})
    return prompts, cached, replicas
