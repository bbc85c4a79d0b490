"""The drafters the decode loop runs, behind one batched interface (drafter.py); none imports the loop."""
