"""Each drafter family's training method (the loop's Method contract) and the losses they share."""
