// Package longtest is a stand-in long test for chaos's longTest: it runs
// only with KETTLE_HA_LONG=1, logs a figure and two lines, and fails when
// LONGTEST_FAIL is set.
package longtest

import (
	"os"
	"testing"
)

func TestLong(t *testing.T) {
	if os.Getenv("KETTLE_HA_LONG") == "" {
		t.Skip("KETTLE_HA_LONG")
	}
	t.Log("figure: span = 1.5 s")
	t.Log("kept: this line")
	t.Log("dropped: this one")
	if os.Getenv("LONGTEST_FAIL") != "" {
		t.Fatal("failed as asked")
	}
}
