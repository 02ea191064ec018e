"""What people are told: the STATUS= line, the guard's state in words, doctor's checks, alerts, rates."""
