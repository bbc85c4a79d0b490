"""Training: the launch scripts (train/<recipe>.py) over the shared loop, data, methods and recipes below
them."""
