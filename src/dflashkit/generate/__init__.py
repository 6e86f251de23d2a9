"""The generate client: regenerate every assistant turn of the prepared conversations with the target.

    openai_client.py   the asyncio client for OpenAI-compatible servers (retries, load balancing)
    http1.py           the lean keep-alive HTTP/1.1 transport the client uses by default
    preflight.py       request bodies, sampling settings, and the one-request chat-template check
    conversations.py   turn planning, prompts for turn t, assembling finished conversations
    journal.py         the append-only, exactly-once journal of finished turns
    regenerate.py      the loop: journal → requests → journal, then conversations.jsonl

`stages/generate.py` reads the config, starts a local `dflashkit serve` when `server.urls` is empty
(`serving.local`) and writes the manifest; everything else lives here.
"""
