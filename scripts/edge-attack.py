#!/usr/bin/env python3
"""Connection exhaustion against a running Airlock router, from this machine only.

Opens CONNECTIONS half-sent requests (unfinished headers, bodies that stop short with and
without a key, chunked bodies that never end) spread over loopback source addresses
127.0.0.2 and up, holds them for HOLD seconds, and meanwhile sends one whole chat request with
a valid key every INTERVAL seconds. Prints how the keyed requests fared, how the attackers
were answered, and how many attacking connections the server had closed by the end.

Only loopback targets are accepted. Bounded in count (--connections) and time (--hold).

    scripts/edge-attack.py --url http://127.0.0.1:8080 --key sk-... --connections 3000
"""

import argparse
import json
import resource
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request


def half_requests(key):
    auth = f"Authorization: Bearer {key}\r\n"
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: airlock\r\nContent-Type: application/json\r\n"
    return [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: airlock\r\nX-Slow: ",
        (head + auth + "Content-Length: 1000\r\n\r\n{\"model\":").encode(),
        (head + auth + "Transfer-Encoding: chunked\r\n\r\n9\r\n{\"model\":").encode(),
        (head + "Content-Length: 1000\r\n\r\n{\"model\":").encode(),
    ]


def attack(host, port, count, key, sockets, answers):
    requests = half_requests(key)
    for i in range(count):
        source = f"127.0.0.{2 + i % 200}"
        sock = socket.socket()
        sock.setblocking(True)
        sock.settimeout(5)
        try:
            sock.bind((source, 0))
            sock.connect((host, port))
            sock.sendall(requests[i % len(requests)])
        except OSError as error:
            answers[f"connect failed: {type(error).__name__}"] = answers.get(
                f"connect failed: {type(error).__name__}", 0) + 1
            sock.close()
            continue
        sock.setblocking(False)
        sockets.append(sock)


def poll_closed(sockets, answers):
    """Counts the attacking sockets the server has closed, by the status it sent first."""
    still_open = 0
    for sock in sockets:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            still_open += 1
            continue
        except OSError:
            answers["reset"] = answers.get("reset", 0) + 1
            continue
        status = data[9:12].decode(errors="replace") if data.startswith(b"HTTP/1.1") else "closed"
        answers[status] = answers.get(status, 0) + 1
    return still_open


def keyed_requests(url, key, interval, stop, results):
    body = json.dumps({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "temperature": 0,
    }).encode()
    while not stop.is_set():
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
        except OSError as error:
            status = type(error).__name__
        results.append((status, time.monotonic() - started))
        stop.wait(interval)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--key", required=True, help="a valid API key of the server")
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--hold", type=float, default=20.0, help="seconds to hold them")
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    host_port = args.url.split("//", 1)[1].rstrip("/")
    host, port = host_port.rsplit(":", 1)
    if not host.startswith("127.") and host != "localhost":
        raise SystemExit("loopback targets only")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stop = threading.Event()
    results = []
    keyed = threading.Thread(
        target=keyed_requests, args=(args.url, args.key, args.interval, stop, results))
    keyed.start()
    sockets, answers = [], {}
    started = time.monotonic()
    attack(host, int(port), args.connections, args.key, sockets, answers)
    opened = time.monotonic() - started
    print(f"opened {len(sockets)} half-sent requests in {opened:.1f} s", flush=True)
    still_open = len(sockets)
    while time.monotonic() - started < args.hold:
        time.sleep(1)
    still_open = poll_closed(sockets, answers)
    stop.set()
    keyed.join()
    for sock in sockets:
        sock.close()

    ok = [t for s, t in results if s == 200]
    print(f"keyed requests during the attack: {len(ok)} of {len(results)} answered 200"
          f" (others: {sorted(str(s) for s, _ in results if s != 200)})")
    if ok:
        print(f"  latency median {statistics.median(ok) * 1000:.0f} ms, "
              f"max {max(ok) * 1000:.0f} ms")
    print(f"attacking connections after {args.hold:.0f} s: {still_open} still open; "
          f"closed by the server: {dict(sorted(answers.items()))}")


if __name__ == "__main__":
    main()
