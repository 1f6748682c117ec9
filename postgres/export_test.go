package postgres

// SetSmallBatchRows sets the largest batch written by INSERT from arrays
// and returns a function that restores it. Not for parallel tests.
func SetSmallBatchRows(n int) (restore func()) {
	old := smallBatchRows
	smallBatchRows = n
	return func() { smallBatchRows = old }
}
