"""One widget per picture of the dashboard, plus the chat log and the prompt input."""
