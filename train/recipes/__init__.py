"""Each recipe's options and how it builds its drafter; the launch scripts train/<recipe>.py run them."""
