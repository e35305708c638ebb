"""The strata-chat Textual app: chat on the engine in-process and draw its memory live."""
