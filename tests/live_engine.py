"""An engine process's live board, driven line by line from stdin: ``python -m tests.live_engine ENGINE_ID``.

``set KEY JSON`` sets a value; ``publish`` publishes now (else the board does every half second); each
command is answered ``ok``. End of input: the process exits normally (its board removes its file).
"""

from __future__ import annotations

import json
import sys

from kvcompose.live import board


def main(engine_id: str) -> None:
    live = board(engine_id)
    for line in sys.stdin:
        command, _, rest = line.strip().partition(" ")
        if command == "set":
            key, _, value = rest.partition(" ")
            live.set(key, json.loads(value))
        elif command == "publish":
            live.publish()
        print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
