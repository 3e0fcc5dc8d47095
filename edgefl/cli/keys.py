"""`edgefl keys`: a node's or an operator's Ed25519 signing key (docs/security.md,
docs/deployment.md "Keys").

    edgefl keys gen --out /etc/edgefl/keys/client-3     # private key (0600) + client-3.pub
    edgefl keys show /etc/edgefl/keys/client-3.pub      # its fingerprint

The private key goes in the node's site file as keys.signing_key; the public key goes to
whoever checks its signatures: the aggregator's to every board (keys.aggregator), each
board's to the aggregator (keys.fleet), the operator's to the aggregator (keys.operators).
"""
from __future__ import annotations

import argparse
import json

from .command import Command


def _keys_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    gen = sub.add_parser("gen", help="write a new private key (mode 0600) and PATH.pub")
    gen.add_argument("--out", required=True, metavar="PATH",
                     help="the private key file; its public key is written to PATH.pub")
    gen.add_argument("--force", action="store_true",
                     help="replace existing files (the old key is then gone)")
    show = sub.add_parser("show", help="print the fingerprint of a key file (private or "
                                       "public)")
    show.add_argument("path", metavar="PATH")
    for p in (gen, show):
        p.add_argument("--json", action="store_true", help="print JSON")


def _keys(args: argparse.Namespace) -> int:
    from ..transport.signing import fingerprint, load_public_key, write_key_pair

    if args.keys_action == "gen":
        private, public = write_key_pair(args.out, force=args.force)
        fp = fingerprint(load_public_key(public))
        doc = {"private": private, "public": public, "fingerprint": fp}
    else:
        fp = fingerprint(load_public_key(args.path, private_ok=True))
        doc = {"path": args.path, "fingerprint": fp}
    if args.json:
        print(json.dumps(doc))
    elif args.keys_action == "gen":
        print(f"private key {doc['private']} (mode 0600)\npublic key  {doc['public']}\n"
              f"fingerprint {fp}")
    else:
        print(f"{fp}  {args.path}")
    return 0


KEYS = Command("keys", "generate an Ed25519 signing key, or show a key's fingerprint",
               _keys_arguments, _keys)
