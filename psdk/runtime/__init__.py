"""What every task process runs with, on either side: its log label, its liveness beat, failpoints, waits, disks."""
