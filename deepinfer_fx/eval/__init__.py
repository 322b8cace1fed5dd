"""Offline evaluation: ``generate`` and ``score`` as two stages (AIME, GPQA Diamond, HLE), and the
decode-perplexity regression (``ppl``). ``python -m deepinfer_fx.eval --help``; README.md here."""
