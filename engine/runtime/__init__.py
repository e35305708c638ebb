"""The running engine: its parts (`Runtime`), flag changes between requests, and the serve loop
that runs one request at a time."""
